"""Helpers the integration tests share for the processes they start: run a function on N spawned ranks
that report back through a shared dict. (The polled wait is tests/waiting.py's wait_for.)"""

from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp


def spawn_ranks(fn: Callable, args: tuple, nprocs: int = 2) -> dict:
    """Run fn(rank, *args, out) on `nprocs` spawned processes; returns {rank: what the rank put in out}."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(fn, args=(*args, out), nprocs=nprocs, join=True, start_method="spawn")
        return dict(out)

"""Helpers the integration tests share for the processes they start: poll until something shows, and run
a function on N spawned ranks that report back through a shared dict."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.multiprocessing as mp


def wait_for(what: str, predicate: Callable[[], object], timeout_s: float = 60, poll_s: float = 0.02):
    """Poll `predicate` until it returns something truthy (returned), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def spawn_ranks(fn: Callable, args: tuple, nprocs: int = 2) -> dict:
    """Run fn(rank, *args, out) on `nprocs` spawned processes; returns {rank: what the rank put in out}."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(fn, args=(*args, out), nprocs=nprocs, join=True, start_method="spawn")
        return dict(out)

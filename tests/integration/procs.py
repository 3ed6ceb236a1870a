"""Helpers the integration tests share for the processes they start: run a function on N spawned ranks
that report back through a shared dict. (The polled wait is tests/waiting.py's wait_for.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil
import torch.multiprocessing as mp


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every process of this machine that belongs to the run: its directory on the command line or as its
    RLSLURM_RUN_DIR (ranks, engines, reward service, node agent, the local controller)."""
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []) or \
                    (p.info["environ"] or {}).get("RLSLURM_RUN_DIR") == str(run_dir):
                out.append(p)
        except psutil.Error:
            pass
    return out


def spawn_ranks(fn: Callable, args: tuple, nprocs: int = 2) -> dict:
    """Run fn(rank, *args, out) on `nprocs` spawned processes; returns {rank: what the rank put in out}."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(fn, args=(*args, out), nprocs=nprocs, join=True, start_method="spawn")
        return dict(out)

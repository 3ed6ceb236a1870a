"""A CPU trainer rank's memory cap: hardware.hbm_gb made real, as a GPU's HBM is, in a memory cgroup of its own.

    how = cap_rank(run, job, rank)     # cpu profile: this process may hold hbm_gb beyond its start-up RSS

On a GPU the plan's verdict is kept by the hardware: a rank whose tensors pass the card's memory gets an OOM.
CPU worker processes standing in for GPUs have no such wall, so a plan that says `ok` would be a claim nobody
checks, and one that says `OOM` would be a number nobody feels. Each trainer rank of a `cpu`-profile job moves
itself into a memory cgroup (v1 or v2, whichever this machine mounts) beside the one it runs in, limited to
hardware.hbm_gb, swap off. Neither cgroup version moves the pages a process already holds with it, so what the
rank holds at that moment (interpreter, torch, the libraries: what a GPU's runtime keeps outside HBM) stays
charged where it was, and the cap is on what the rank allocates from then on: its model, optimizer,
activations. Past it the kernel kills the rank, and the node agent names the OOM from the cgroup's oom_kill
count (diag/deaths.py). Where no memory cgroup can be made (not root, no controller), the
rank runs uncapped and says so in a `memory_capped` event. The rank caps itself once it has imported the
libraries it trains with (jobs/entry.py), and the processes it starts (engines, the reward service) leave its
cgroup first thing (rlslurm/lifetime.py leave_parent_cap): only the rank's own allocations meet the cap.

Lifecycle: the cgroup is made at the rank's start and removed at its exit (the process moves back first). One
left by a rank that was killed is the kernel's evidence of how it died: the node agent reads its oom_kill count
into a `rank_died` event and then removes it (diag/deaths.py), and a rank of the same run that caps itself
later (a restart, a requeue) removes what its run left. Never another run's: on a shared machine that would
take a dead rank's evidence before its own agent read it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
from pathlib import Path
from typing import Iterable

import psutil

from rlslurm import events, lifetime
from rlslurm.rundir import RunDir

PREFIX = "rlslurm-rank-"


def _memory_cgroup() -> tuple[Path, bool] | None:
    """(this process's memory cgroup directory, whether it is cgroup v2), or None where none is mounted."""
    mounts = {}
    with open("/proc/mounts") as f:
        for line in f:
            _, where, kind, options, *_ = line.split()
            if kind == "cgroup" and "memory" in options.split(","):
                mounts["v1"] = where
            elif kind == "cgroup2":
                mounts.setdefault("v2", where)
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in lines:
        if "memory" in controllers.split(",") and "v1" in mounts:
            return Path(mounts["v1"]) / path.lstrip("/"), False
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and controllers == "" and "v2" in mounts:
            base = Path(mounts["v2"]) / path.lstrip("/")
            if "memory" in (base / "cgroup.controllers").read_text().split():
                return base, True
    return None


def remove_stale(group: Path) -> bool:
    """Remove a rank's cgroup once its rank is gone (rmdir only succeeds on an empty one); True if it is gone."""
    if not group.name.startswith(PREFIX):
        return False
    with contextlib.suppress(OSError, ValueError):
        if not psutil.pid_exists(int(group.name[len(PREFIX):])):
            group.rmdir()
    return not group.exists()


def cap_process(limit_gb: float, stale: Iterable[Path] = ()) -> dict:
    """Move this process into a fresh memory cgroup limited to `limit_gb` of what it allocates from now on;
    first remove the `stale` cgroups (its own run's, of ranks gone) that nothing removed."""
    rss = psutil.Process().memory_info().rss
    found = _memory_cgroup()
    if found is None:
        return {"capped": False, "reason": "no memory cgroup is mounted here"}
    base, v2 = found
    group = base / f"{PREFIX}{os.getpid()}"
    limit = int(limit_gb * 1e9)
    try:
        for group_left in stale:
            remove_stale(Path(group_left))
        group.mkdir(exist_ok=True)
        files = (("memory.max", limit), ("memory.swap.max", 0)) if v2 else (
            ("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit))
        for name, value in files:
            if (group / name).exists():
                (group / name).write_text(str(value))
        # What the rank starts (engines, the reward service) goes back to `base` first thing (rlslurm/lifetime.py);
        # named before the move, so no child started meanwhile is in the cap without knowing its way out.
        os.environ[lifetime.UNCAPPED_ENV] = str(base)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        os.environ.pop(lifetime.UNCAPPED_ENV, None)
        with contextlib.suppress(OSError):
            group.rmdir()
        return {"capped": False, "reason": f"cannot make a memory cgroup under {base}: {e.strerror or e}"}

    def release():
        with contextlib.suppress(OSError):
            (base / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()

    atexit.register(release)
    return {"capped": True, "cap_gb": round(limit_gb, 6), "rss_at_cap_gb": round(rss / 1e9, 6),
            "limit_bytes": limit, "cgroup": str(group)}


def cap_rank(run: RunDir, job, rank: int) -> dict | None:
    """A `cpu`-profile trainer rank caps itself at hardware.hbm_gb (module docstring); None on a GPU profile."""
    if job.hardware.profile != "cpu":
        return None
    left = [e["cgroup"] for e in events.read_events(run, events.MEMORY_CAPPED)
            if e.get("capped") and e.get("host") == socket.gethostname()]
    how = cap_process(job.hardware.gpu_mem_gb, stale=left)
    events.emit(run, events.MEMORY_CAPPED, role="trainer", rank=rank, hbm_gb=job.hardware.gpu_mem_gb, **how)
    return how

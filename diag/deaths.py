"""Trainer ranks that died without a word, noticed by the node agent and named with the kernel's evidence.

A rank killed by the kernel's OOM killer, a segfault or a SIGKILL writes nothing: its heartbeat still says
`running` and its peers fail later in a collective. The node agent (diag/watchdog.py) sees every rank of its
node each poll; one whose process is gone while its heartbeat still says `running` gets a `rank_died` event
with what the kernel kept about it, read from outside the dead process:

- its memory cgroup (as SLURM's task/cgroup confines a step: /proc/<pid>/cgroup, read while it lived) and
  that cgroup's `oom_kill` counter (cgroup v1 memory.oom_control, v2 memory.events) before and after: a
  counter that grew is the OOM killer's own record that it killed a process there;
- the node's `oom_kill` counter in /proc/vmstat, the same for OOM kills outside any limited cgroup.

A rank of a `cpu`-profile job runs in a memory cgroup of its own (rlslurm/memcap.py, its `memory_capped`
event names it). Such a rank can die before the agent's first look (a first step past the cap); the agent
reads the run's `memory_capped` events too, and a capped rank that is gone with a grown oom_kill count in its
cgroup gets its `rank_died` all the same. Once read, the agent removes the dead rank's cgroup.

Why counters, not the exit status or the kernel log: the agent is not the rank's parent (no wait status),
and the kernel log (dmesg) needs privileges users do not have on a cluster; the counters are readable by
the job's own user. On a cluster whose SLURM has task/cgroup, slurmstepd also writes "Detected N oom_kill
events" into the step's log, which diag/summary.py reads as well.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlslurm.diag.heartbeat import label, pid_alive, read_heartbeats
from rlslurm.events import MEMORY_CAPPED, RANK_DIED, emit, read_events
from rlslurm.memcap import remove_stale
from rlslurm.rundir import RunDir

log = logging.getLogger("rlslurm.diag.deaths")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")


def memory_cgroup(proc_cgroup: str) -> tuple[int, str] | None:
    """(cgroup version, path) of the memory controller from the text of /proc/<pid>/cgroup.

    v1 lines read `N:controllers:/path` (memory among the controllers); the v2 line reads `0::/path`, used
    when no v1 hierarchy has the memory controller."""
    v2 = None
    for line in proc_cgroup.splitlines():
        num, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return 1, path
        if num == "0" and controllers == "":
            v2 = (2, path)
    return v2


def memory_dir(version: int, path: str, root: Path = CGROUP_ROOT) -> Path:
    """The directory of a memory cgroup: v1 under root/memory, v2 under root (root/unified on a hybrid host)."""
    rel = path.lstrip("/")
    if version == 1:
        return root / "memory" / rel
    return (root / rel) if (root / "cgroup.controllers").exists() else (root / "unified" / rel)


def keyed(text: str) -> dict[str, int]:
    """A flat keyed file (`key value` per line: memory.oom_control, memory.events, /proc/vmstat) as ints."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def oom_kills(cgroup: Path) -> int | None:
    """The OOM killer's count of kills in this memory cgroup (None: not readable, or a kernel too old to say)."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        text = _read(cgroup / name)
        count = keyed(text).get("oom_kill") if text is not None else None
        if count is not None:
            return count
    return None


def _bytes(cgroup: Path, *names: str) -> int | None:
    """The first of `names` in the cgroup that holds a number of bytes (v2's "max" means no limit)."""
    for name in names:
        text = _read(cgroup / name)
        if text is not None and text.strip().isdigit():
            return int(text)
    return None


@dataclass
class Seen:
    """A live rank as the agent saw it: its latest heartbeat, and each counter as it was when the agent first saw
    the rank there (not at the latest look: a killed process is still alive while the kernel frees its memory,
    with the counters already grown, and in cgroup v1 it leaves its cgroup for the root one on its way out)."""

    hb: dict
    cgroups: dict[Path, int | None]
    """Every memory cgroup the rank was seen in, in order, with its oom_kill count at first sight there."""
    node_oom_kills: int | None
    """The node's oom_kill count when the rank was first seen."""


class DeathWatch:
    """The node agent's eye for trainer ranks that died without a word (see the module docstring)."""

    CAPPED_EVERY_S = 30.0
    """How often a look without a death also reads the run's `memory_capped` events (they come at rank starts)."""

    def __init__(self, run: RunDir, *, proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT,
                 alive: Callable[[dict], bool] = pid_alive, host: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.run, self.proc, self.cgroup_root, self.alive = run, proc, cgroup_root, alive
        self.host, self.clock = host or socket.gethostname(), clock
        self.seen: dict[int, Seen] = {}
        self.spared: set[int] = set()
        """Pids the agent ended itself (a hang's kill): their end is the `hang_action` event's."""
        self.reported: set[int] = set()
        """Pids whose death has its `rank_died` (or needs none)."""
        self.done_capped: set[str] = set()
        """Capped ranks' cgroups already read and removed."""
        self.capped_at = -self.CAPPED_EVERY_S

    def node_oom_kills(self) -> int | None:
        text = _read(self.proc / "vmstat")
        return None if text is None else keyed(text).get("oom_kill")

    def _cgroup(self, pid: int) -> Path | None:
        text = _read(self.proc / str(pid) / "cgroup")
        found = memory_cgroup(text) if text else None
        return memory_dir(*found, root=self.cgroup_root) if found else None

    def look(self, watched: list[dict], final: bool = False) -> list[dict]:
        """One look: note every live trainer rank of `watched` (their heartbeats), and emit `rank_died` for
        each rank seen alive before that is gone now while its heartbeat still says `running`."""
        node_count = self.node_oom_kills()
        live = set()
        for hb in watched:
            if hb.get("role") != "train" or not hb.get("pid"):
                continue
            pid = int(hb["pid"])
            live.add(pid)
            seen = self.seen.setdefault(pid, Seen(hb, {}, node_count))
            seen.hb = hb
            # Read every poll: a cgroup is where the process is now (SLURM may move a task after it started).
            cgroup = self._cgroup(pid)
            if cgroup is not None and cgroup not in seen.cgroups:
                seen.cgroups[cgroup] = oom_kills(cgroup)
        died, gone = [], [p for p in self.seen if p not in live]
        beats = read_heartbeats(self.run) if gone else []
        for pid in gone:
            seen = self.seen.pop(pid)
            latest = next((hb for hb in beats if hb.get("pid") == pid
                           and hb.get("role") == seen.hb.get("role") and hb.get("rank") == seen.hb.get("rank")), None)
            # Gone from the watched list for a reason of its own (it wrote `exited`/`failed` on its way out),
            # or ended by the agent itself: not a death without a word.
            if latest is None or latest.get("state") != "running" or self.alive(latest) or pid in self.spared:
                continue
            died.append(self._emit(latest, seen, node_count))
        if final or died or gone or self.clock() - self.capped_at >= self.CAPPED_EVERY_S:
            died += self.look_capped(live, node_count)
        return died

    def look_capped(self, live: set[int], node_count: int | None) -> list[dict]:
        """The run's capped ranks on this host (memcap) that are gone: a `rank_died` for one whose cgroup counted
        an OOM kill and that no look saw die; then its cgroup is removed (the evidence is in the event now)."""
        self.capped_at = self.clock()
        died = []
        for e in read_events(self.run, MEMORY_CAPPED):
            if not e.get("capped") or e.get("host") != self.host or e["cgroup"] in self.done_capped:
                continue
            pid, cgroup = int(e["pid"]), Path(e["cgroup"])
            # A process leaves its cgroup as it exits, before its parent reaps it: an empty cgroup is a dead rank
            # even while its pid (a zombie) is still there to see.
            tasks = _read(cgroup / "cgroup.procs")
            if pid in live or (tasks is not None and tasks.strip()) or (
                    tasks is None and pid not in self.reported and self.alive({"pid": pid, "host": self.host})):
                continue
            kills = oom_kills(cgroup)
            if kills and pid not in self.reported and pid not in self.spared:
                beats = [hb for hb in read_heartbeats(self.run) if hb.get("pid") == pid]
                hb = beats[0] if beats else {"pid": pid, "role": "train", "rank": e.get("rank")}
                died.append(self._emit(hb, Seen(hb, {cgroup: 0}, None), node_count))
            self.reported.add(pid)
            if remove_stale(cgroup) or not cgroup.exists():
                self.done_capped.add(e["cgroup"])
        return died

    def _capped_cgroup(self, pid: int) -> Path | None:
        """The memory cgroup memcap made for rank `pid` on this host (its `memory_capped` event), if any."""
        return next((Path(e["cgroup"]) for e in read_events(self.run, MEMORY_CAPPED)
                     if e.get("capped") and e.get("host") == self.host and int(e.get("pid") or 0) == pid), None)

    def _emit(self, hb: dict, seen: Seen, node_count: int | None) -> dict:
        cgroups = dict(seen.cgroups)
        capped = self._capped_cgroup(int(hb["pid"]))
        if capped is not None and capped not in cgroups:
            # Seen in CI: the agent last looked before the rank moved itself into its cap (it caps itself once
            # torch is in), and the kill there read as +0 in the cgroup it was seen in. Made for this rank alone at
            # its start, the capped cgroup's every kill is the rank's.
            cgroups[capped] = 0
        grown = {cg: oom_kills(cg) - before for cg, before in cgroups.items()
                 if before is not None and oom_kills(cg) is not None}
        # The cgroup whose count grew, else the latest the rank was seen in that has a count.
        cgroup = next((cg for cg, n in grown.items() if n > 0), next(reversed(grown), None))
        cgroup_kills = grown.get(cgroup)
        node_kills = (node_count - seen.node_oom_kills) if node_count is not None and \
            seen.node_oom_kills is not None else None
        fields = dict(rank_pid=int(hb["pid"]), phase=hb.get("phase"), step=hb.get("step"),
                      cgroup=str(cgroup) if cgroup else None, cgroup_oom_kills=cgroup_kills,
                      node_oom_kills=node_kills,
                      # The cgroup's count is this rank's own evidence; the node's counts any process's kill,
                      # so it decides only where no cgroup counter could be read.
                      oom_killed=bool(cgroup_kills) if cgroup_kills is not None else bool(node_kills),
                      memory_limit_bytes=_bytes(cgroup, "memory.max", "memory.limit_in_bytes") if cgroup else None,
                      memory_peak_bytes=_bytes(cgroup, "memory.peak", "memory.max_usage_in_bytes") if cgroup else None)
        self.reported.add(fields["rank_pid"])
        log.error("%s (pid %s) died without a word in phase %s step %s; OOM killer: %s (cgroup %s: +%s kills, "
                  "node: +%s)", label(hb), fields["rank_pid"], fields["phase"], fields["step"], fields["oom_killed"],
                  fields["cgroup"], cgroup_kills, node_kills)
        return emit(self.run, RANK_DIED, role=hb.get("role"), rank=hb.get("rank"), **fields)

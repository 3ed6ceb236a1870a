"""Heartbeats: one small JSON file per process in <run>/heartbeats/<role>-<rank>.json.

    writer = HeartbeatWriter(run, role="train", rank=0, interval_s=1.0)
    writer.update(phase="train", step=41, phase_timeout_s=300.0, progress=True)

A heartbeat says who the process is (host, pid, role, rank, job id), where it is (phase, step, that
phase's timeout) and when it last made progress. The watchdog (diag/watchdog.py, a separate process
on the same node) compares `last_progress` with `phase_timeout_s`; `rlslurm diag` shows the table.

Cost on the hot path: `enter()` and `update()` only change the record in memory (~3 us inside a step);
`beat()` is one step of a C counter (itertools.count), no Python frame. A flusher thread reads the counter
four times an interval and writes the record when it changed, at most once per `interval_s`: a JSON dump
into a temp file and an atomic rename, without fsync (a heartbeat lost in a crash of the node is worth
nothing, and fsync on NFS costs milliseconds). On ext4 here one such write costs 0.2-3 ms, so writing
at every phase change of a fast step would break the 1 % budget; the thread keeps it to one per second.
The thread never makes progress up: `last_progress` is the time the work set (phases, updates) or, for
counted beats, the flusher's previous read of the counter (a beat came after it), never later than the
work made it, so a wedged main thread still ages its heartbeat.

A heartbeat that cannot be written (OSError: its directory unwritable, the disk full) never stops the
work nor the flusher: the first failure is a `heartbeat_unwritable` event (its path, error and errno;
where the events log cannot be written either, a log line on stderr), writes are retried once per
interval, and the first that succeeds again is a `heartbeat_restored` event. The node agent reads the
event and stops judging that process by heartbeat age (diag/watchdog.py says why).

Lifecycle: started by the constructor (background=True), stopped by `close()`; it waits on an Event, so
close() ends it at once. With background=False (tests,
a process that must not start threads) `update()` writes synchronously, coalesced the same way.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from rlslurm import events
from rlslurm.node import node_name
from rlslurm.rundir import RunDir

log = logging.getLogger("rlslurm.heartbeat")


ENDED_STATES = ("exited", "failed")
"""Heartbeat states a process writes as its last (diag/guard.py): it left, cleanly or not. A heartbeat in one
of them says nothing about a live process, however recent it is."""


def has_ended(hb: dict) -> bool:
    """Whether the heartbeat is its process's last word (state `exited` or `failed`)."""
    return hb.get("state") in ENDED_STATES


def heartbeat_path(run: RunDir, role: str, rank: int) -> Path:
    return run.heartbeats / f"{role}-{rank}.json"


class HeartbeatWriter:
    """Keeps this process's heartbeat in memory and writes it at most once per `interval_s`."""

    def __init__(self, run: RunDir, role: str, rank: int, *, interval_s: float,
                 clock: Callable[[], float] = time.time, job_id: str | None = None,
                 host: str | None = None, background: bool = True):
        self.run = run
        self.error: OSError | None = None
        """Why the last write failed; None while writes succeed."""
        self.unwritable_since: float | None = None
        try:
            run.heartbeats.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.error = e  # reported by the first write, which fails the same way
        self.path = heartbeat_path(run, role, rank)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.interval_s = interval_s
        self.clock = clock
        now = clock()
        self.record: dict = {
            "host": host or node_name(),
            # The machine's own name: SLURM's node name (`host`) is not one, the local cluster runs 5 on one.
            "machine": socket.gethostname(),
            "pid": os.getpid(),
            # The process's start time lets a reader tell this pid from a later process that reused it.
            "pid_started": psutil.Process().create_time(),
            "role": role,
            "rank": rank,
            "job_id": job_id or os.environ.get("SLURM_JOB_ID"),
            "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "state": "running",
            "phase": None,
            "step": None,
            "phase_timeout_s": None,
            "phase_started": now,
            "last_progress": now,
            "written": now,
            "beats": 0,
        }
        self._last_write = float("-inf")
        self._dirty = True
        self._lock = threading.Lock()  # the flusher and a forced write must not share the temp file at once
        self._stop = threading.Event()
        self._thread = None
        self.beat: Callable[[], object] = self.update
        """Progress from the hot path (a micro-batch, a generated chunk). Synchronous: an `update`. With the flusher:
        one step of a C counter, which the flusher reads and dates (`_count_beats`)."""
        # Why a counter: inside a training step each Python frame costs ~1.5 us, not the ~0.05 us of a tight loop (the
        # step's torch work has evicted the interpreter's caches; bench/bench_opskit.py measures it in place); a
        # `next()` of itertools.count runs no Python frame at all.
        self._counter = itertools.count()
        self._reads = 0  # the flusher's own steps of the counter
        self._counted = 0  # beats counted so far
        self._looked = now  # when the flusher last read the counter
        self._counted_progress = float("-inf")  # the latest progress the counter proves
        if background:
            self.beat = self._counter.__next__
            self._thread = threading.Thread(target=self._flusher, name=f"heartbeat-{role}-{rank}", daemon=True)
            self._thread.start()

    def update(self, *, progress: bool = True, force: bool = False, **fields) -> bool:
        """Merge `fields` into the heartbeat; True if it was written now (forced, or synchronous mode)."""
        now = self.clock()
        record = self.record
        if progress:
            record["last_progress"] = now
            record["beats"] += 1
        if fields:
            record.update(fields)
        self._dirty = True
        if force or (self._thread is None and now - self._last_write >= self.interval_s):
            self._write(now)
            return True
        return False

    def enter(self, phase: str | None, step: int | None, phase_timeout_s: float, started: bool) -> None:
        """Progress into `phase` of `step`: a new phase when `started` (its start time is now), else back in an outer
        one. `update`'s work for phase boundaries, without its **fields dict."""
        now = self.clock()
        record = self.record
        record["phase"] = phase
        record["step"] = step
        record["phase_timeout_s"] = phase_timeout_s
        if started:
            record["phase_started"] = now
        record["last_progress"] = now
        record["beats"] += 1
        self._dirty = True
        if self._thread is None and now - self._last_write >= self.interval_s:
            self._write(now)

    def flush(self) -> None:
        """Write the record now if it changed since the last write."""
        if self._dirty:
            self._write(self.clock())

    def close(self) -> None:
        """Stop the flusher thread and write the final record."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._count_beats(self.clock())
        self.flush()

    def _flusher(self) -> None:
        # It reads the beat counter four times an interval, so a beat is dated at most a quarter interval early; it
        # writes at most once an interval.
        while not self._stop.wait(self.interval_s / 4):
            now = self.clock()
            self._count_beats(now)
            if self._dirty and now - self._last_write >= self.interval_s:
                self._write(now)

    def _count_beats(self, now: float) -> None:
        """Take the beats counted since the last read (the flusher's thread, or close() once it ended)."""
        total = next(self._counter) - self._reads  # every earlier read took one step of the counter too
        self._reads += 1
        if total > self._counted:
            # A beat came after the previous read: dated then, never later than the work made it, so a wedged
            # main thread still ages its heartbeat.
            self._counted, self._counted_progress, self._dirty = total, self._looked, True
        self._looked = now

    def _write(self, now: float) -> None:
        with self._lock:
            self._dirty = False
            record = dict(self.record)  # a copy: the main thread may update the record meanwhile
            record["written"] = now
            # The counted beats join the record here, never in it: the main thread's update() writes it unlocked.
            record["beats"] += self._counted
            record["last_progress"] = max(record["last_progress"], self._counted_progress)
            self._last_write = now  # a failed write is retried one interval later, not at every update
            try:
                with open(self._tmp, "w") as f:
                    f.write(json.dumps(record))
                os.replace(self._tmp, self.path)
            except OSError as e:
                self._dirty = True
                with contextlib.suppress(OSError):
                    self._tmp.unlink(missing_ok=True)  # a half-written temp file holds the space that ran out
                if self.unwritable_since is None:
                    self.unwritable_since = now
                    # The error without its file name: that is the temp file; `path` names the heartbeat.
                    said = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
                    self._report(events.HEARTBEAT_UNWRITABLE, path=str(self.path), error=f"{type(e).__name__}: {said}",
                                 errno=e.errno)
                self.error = e
                return
            if self.unwritable_since is not None:
                self._report(events.HEARTBEAT_RESTORED, path=str(self.path),
                             unwritable_s=round(now - self.unwritable_since, 3))
                self.unwritable_since = self.error = None

    def _report(self, kind, **fields) -> None:
        """An event of this process's heartbeat; a log line where the events log cannot be written either
        (a full disk under the whole run directory)."""
        try:
            events.emit(self.run, kind, role=self.record["role"], rank=self.record["rank"], **fields)
        except OSError as e:
            log.error("%s %s-%s %s (and the event could not be written: %s)", kind.name, self.record["role"],
                      self.record["rank"], fields, e)


def still_unwritable(evts: list[dict]) -> list[dict]:
    """The `heartbeat_unwritable` events of `evts` that no `heartbeat_restored` of the same process followed."""
    latest: dict[tuple, dict] = {}
    for e in events.select(evts, events.HEARTBEAT_UNWRITABLE, events.HEARTBEAT_RESTORED):
        who = (e.get("host"), e.get("role"), e.get("rank"), e.get("pid"))
        if events.kind_of(e) is events.HEARTBEAT_UNWRITABLE:
            latest[who] = e
        else:
            latest.pop(who, None)
    return list(latest.values())


def read_heartbeat(path: Path) -> dict | None:
    """One heartbeat file, or None if it is unreadable (renamed away in the instant we opened it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_heartbeats(run: RunDir) -> list[dict]:
    """Every heartbeat of the run, sorted by role and rank; each gets its file name as `file`."""
    beats = []
    for path in sorted(run.heartbeats.glob("*.json")) if run.heartbeats.is_dir() else []:
        hb = read_heartbeat(path)
        if hb is not None:
            hb["file"] = path.name
            beats.append(hb)
    return sorted(beats, key=lambda h: (str(h.get("role")), int(h.get("rank") or 0)))


def process_started(pid: int) -> float | None:
    """Start time of `pid`, or None when no such (live, not zombie) process exists."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def pid_alive(hb: dict) -> bool:
    """Is the heartbeat's process still the one running under that pid on this host?"""
    try:
        started, recorded = process_started(int(hb["pid"])), hb.get("pid_started")
        return started is not None and (recorded is None or abs(started - float(recorded)) <= 1.0)
    except (KeyError, TypeError, ValueError):
        return False


def gone_here(hb: dict) -> bool:
    """The heartbeat's process certainly runs no more: it beat from this machine, and no process here has its
    pid and start time. (From another machine, or from a writer older than the `machine` field: not known.)"""
    return hb.get("machine") == socket.gethostname() and not pid_alive(hb)


def label(hb: dict) -> str:
    """`train-1`: how events and summaries name one rank."""
    return f"{hb.get('role')}-{hb.get('rank')}"


def table(beats: list[dict], now: float | None = None) -> str:
    """The heartbeats as a fixed-width text table (for `rlslurm diag` and humans)."""
    now = time.time() if now is None else now
    head = f"{'rank':<12} {'host':<14} {'pid':>7} {'state':<8} {'phase':<12} {'step':>6} {'age_s':>8} {'timeout_s':>9}"
    rows = [head]
    for hb in beats:
        age = now - float(hb.get("last_progress") or now)
        rows.append(f"{label(hb):<12} {str(hb.get('host')):<14} {hb.get('pid', ''):>7} "
                    f"{str(hb.get('state')):<8} {str(hb.get('phase')):<12} {str(hb.get('step')):>6} "
                    f"{age:>8.1f} {str(hb.get('phase_timeout_s')):>9}")
    return "\n".join(rows) + "\n"

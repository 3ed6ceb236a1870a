"""The drain gate: one flag that says "stop taking work, finish the in-flight step, checkpoint, leave".

Who raises it:
  - SIGUSR1: SLURM's pre-timeout signal (`--signal=USR1@N`) or `scancel -s USR1`; we requeue ourselves.
  - SIGTERM: `scontrol requeue`, preemption or scancel; SLURM sends SIGKILL KillWait seconds later, so
    `kill_wait_left_s()` says whether a checkpoint still fits (rlslurm/lifecycle.py decides).
  - a `control/drain` file in the run directory (`touch <run>/control/drain` by hand; in rlslurm always through
    `request_drain` below: `rlslurm drain`, the node agent on a hang, a USR1 before the gate is up), noticed by
    `check()`. A file older than this process (by more than
    STALE_MARGIN_S) is a request to an earlier start of the job: the node agent writes one on a hang and
    then requeues, and the ranks it drained never lived to remove it. It is ignored (one
    `drain_request_stale` event), or every requeued start would drain at once. A drained job removes
    the file itself (`consume_control_file`).
  - code: `gate.request("reason")`.

Lifecycle: build one gate per process, `install_signal_handlers()` once from the main thread (Python
only lets the main thread install handlers), then call `check()` at every phase/step boundary; it is
cheap (the control file is stat'ed at most every `poll_interval_s`, on the injectable clock). Once
requested the flag stays up for the life of the process; `restore_signal_handlers()` puts the previous
handlers back. The handlers only store the signal number and the clock reading (no I/O, no locks: a
handler runs between two bytecodes of the main thread, which may hold any lock); `check()` turns the
first observed request into one `drain_requested` event.
"""

from __future__ import annotations

import math
import os
import signal as _signal
import time
from pathlib import Path
from typing import Callable, Iterable

import psutil

from rlslurm import events
from rlslurm.rundir import RunDir

DRAIN_FILE = "drain"
STALE_MARGIN_S = 1.0
"""A control file this much older than the process start is stale (mtime and start are wall clock)."""


def request_drain(run: RunDir, reason: str) -> Path:
    """Write <run>/control/drain (atomically: write, then rename), which every drain gate of the run notices at its
    next boundary; the one writer of the file (`rlslurm drain`, the node agent on a hang, a USR1 that came before
    the gate was up). Safe in a Python signal handler: no lock, a fresh name per process."""
    run.control.mkdir(parents=True, exist_ok=True)
    path = run.control / DRAIN_FILE
    tmp = path.with_name(f".{DRAIN_FILE}.{os.getpid()}.tmp")
    tmp.write_text(reason + "\n")
    os.replace(tmp, path)
    return path


class DrainGate:
    """A sticky drain request fed by signals, the run's control/drain file, or code."""

    def __init__(self, run: RunDir | None = None, *, clock: Callable[[], float] = time.monotonic,
                 poll_interval_s: float = 1.0, kill_wait_s: float = 30.0, not_before: float | None = None):
        self.run, self.clock = run, clock
        # Wall-clock time (like a file's mtime) before which a control file belongs to an earlier start.
        self.not_before = psutil.Process().create_time() - STALE_MARGIN_S if not_before is None else not_before
        self._stale_seen: float | None = None
        self.poll_interval_s, self.kill_wait_s = poll_interval_s, kill_wait_s
        self._reason: str | None = None
        self._signum: int | None = None
        self._signal_at: float | None = None
        self._requested_at: float | None = None
        self._next_poll = -math.inf
        self._announced = False
        self._previous: dict[int, object] = {}

    def request(self, reason: str) -> None:
        """Raise the flag; the first reason wins (a later SIGTERM still records its deadline)."""
        if self._reason is None:
            self._reason = reason
            self._requested_at = self.clock()

    def _on_signal(self, signum, frame) -> None:
        # Async-signal context: store state only. SIGTERM's time matters for the KillWait deadline even
        # when a SIGUSR1 came first, so it is recorded separately.
        now = self.clock()
        # A second SIGTERM (SLURM's own and the trainer supervisor's, passed on) keeps the first one's deadline.
        if (signum == _signal.SIGTERM and self._signum != _signal.SIGTERM) or self._signum is None:
            self._signum, self._signal_at = signum, now
        if self._reason is None:
            self._reason = f"signal {_signal.Signals(signum).name}"
            self._requested_at = now

    @property
    def requested(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def signal_name(self) -> str | None:
        """SIGTERM / SIGUSR1 / ... when a signal raised or joined the request."""
        return None if self._signum is None else _signal.Signals(self._signum).name

    @property
    def requested_at(self) -> float | None:
        """Clock reading of the first request."""
        return self._requested_at

    def kill_wait_left_s(self) -> float | None:
        """Seconds until SLURM's SIGKILL after our SIGTERM (KillWait), or None when no SIGTERM came."""
        if self._signum != _signal.SIGTERM:
            return None
        return self.kill_wait_s - (self.clock() - self._signal_at)

    def check(self) -> bool:
        """Whether to drain; notices the control file at most every poll_interval_s. Call at boundaries."""
        if self._reason is None and self.run is not None:
            now = self.clock()
            if now >= self._next_poll:
                self._next_poll = now + self.poll_interval_s
                self._poll_control_file()
        if self._reason is not None and not self._announced:
            self._announced = True
            if self.run is not None:
                events.emit(self.run, events.DRAIN_REQUESTED, reason=self._reason, signal=self.signal_name,
                            kill_wait_left_s=self.kill_wait_left_s())
        return self._reason is not None

    def _poll_control_file(self) -> None:
        path = self.run.control / DRAIN_FILE
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime >= self.not_before:
            self.request(f"control file {path}")
        elif self._stale_seen != mtime:
            self._stale_seen = mtime
            events.emit(self.run, events.DRAIN_REQUEST_STALE, file=str(path),
                        reason=f"written {self.not_before + STALE_MARGIN_S - mtime:.1f} s before this process "
                               f"started: a request to an earlier start of the job; ignored")

    def consume_control_file(self) -> bool:
        """Remove control/drain once the drain is done, so the requeued job runs on; True if it was there."""
        if self.run is None:
            return False
        path = self.run.control / DRAIN_FILE
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False

    def install_signal_handlers(self, signals: Iterable[int] = (_signal.SIGUSR1, _signal.SIGTERM)) -> None:
        """Route these signals to the gate (main thread only); the old handlers are kept for restore."""
        for signum in signals:
            self._previous.setdefault(signum, _signal.signal(signum, self._on_signal))

    def restore_signal_handlers(self) -> None:
        for signum, handler in self._previous.items():
            _signal.signal(signum, handler)
        self._previous.clear()


def agreed_reason(gate: DrainGate, world_size: int) -> tuple[str, str | None]:
    """Collective, once the ranks agreed to drain: every rank's reason ("rank 1: signal SIGUSR1; ...") and
    the signal that decides how to leave. SIGTERM wins: SLURM's SIGKILL follows it after KillWait, and it
    is SLURM, not the job, that requeues then. Every rank gets the same answer."""
    import torch.distributed as dist

    seen: list = [None] * world_size
    dist.all_gather_object(seen, (gate.reason, gate.signal_name))
    reasons = [f"rank {r}: {reason}" for r, (reason, _) in enumerate(seen) if reason]
    signals = {name for _, name in seen if name}
    return "; ".join(reasons), "SIGTERM" if "SIGTERM" in signals else next(iter(sorted(signals)), None)

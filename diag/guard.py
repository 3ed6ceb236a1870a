"""The phase guard: every phase of every process goes through it.

    guard = PhaseGuard(run, "train", rank, config.diag, gate=drain_gate)
    with guard:                                   # heartbeat "exited" / "failed" at the end
        for step in range(start, steps):
            with guard.phase("data", step=step):
                batch = next(loader)
            with guard.phase("train", step=step):
                for micro in batch:
                    loss = model(micro).backward()
                    guard.beat()                  # progress, from inside the work
            if guard.drain_requested:
                break

What it does, and why it is built this way:
- Progress beats come from the work itself (per batch, micro-step, generated chunk), never from a
  background thread: a thread would keep beating while the main thread is wedged in an all_reduce,
  which is exactly the hang the watchdog must see.
- Each phase carries its timeout (`diag.phase_timeouts_s[phase]`, else `diag.hang_timeout_s`) into the
  heartbeat, so the node agent (diag/watchdog.py) needs no config of its own to judge a rank.
- Beats and phase changes only touch the heartbeat in memory (a beat is one step of a C counter); its
  flusher thread (diag/heartbeat.py) writes it within `diag.heartbeat_interval_s`, so the file names the
  phase a rank hangs in about one interval after it entered, and the kit costs one small file write per
  interval, not per phase.
- The hot path is a few Python frames a phase and none a beat: inside a training step each frame costs
  ~1.5 us, 30x a tight loop's (cold caches after the step's torch work; bench/bench_opskit.py "in place").
- Phase boundaries call `gate.check()` of the drain gate (diag/drain_gate.py), which also notices a
  `control/drain` file written by the node agent or a human; the loop reads `guard.drain_requested`.
- An exception inside a phase becomes a `phase_failed` event with its traceback, and is re-raised.
- The guard registers faulthandler on SIGURG (see diag/stack_dump.py): the dump of last resort where
  py-spy cannot attach.
- A trainer rank's guard turns on torch's flight recorder and serves it on a node-local socket
  (diag/collectives.py, `diag.collective_trace_entries`): built before the process group, it records every
  collective from the first, and the node agent compares the ranks' records on a hang.
"""

from __future__ import annotations

import faulthandler
import time
import traceback
from typing import Any, Callable

from rlslurm.diag.config import DiagConfig
from rlslurm.diag.heartbeat import HeartbeatWriter
from rlslurm.diag.stack_dump import FAULTHANDLER_SIGNAL, register_faulthandler
from rlslurm.events import PHASE_FAILED, emit
from rlslurm.node import node_name
from rlslurm.rundir import RunDir


def faulthandler_path(run: RunDir, role: str, rank: int, host: str | None = None):
    return run.stacks / f"faulthandler-{host or node_name()}-{role}-{rank}.txt"


class PhaseGuard:
    """Heartbeats, phase timeouts, drain checks and failure events for one process (one role, one rank)."""

    def __init__(self, run: RunDir, role: str, rank: int, config: DiagConfig, gate: Any = None, *,
                 clock: Callable[[], float] = time.time, job_id: str | None = None,
                 faulthandler_fallback: bool = True, background: bool = True):
        self.run, self.role, self.rank, self.config, self.gate = run, role, rank, config, gate
        self.heartbeat = HeartbeatWriter(run, role, rank, interval_s=config.heartbeat_interval_s,
                                         clock=clock, job_id=job_id, background=background)
        self.beat = self.heartbeat.beat
        """Progress inside the current phase, from the work itself (cheap: the heartbeat's counter, no Python frame)."""
        self._stack: list[_Phase] = []
        self._timeouts: dict[str | None, float] = {None: config.timeout_for(None)}  # each phase's, on first use
        self._fh_file = None
        if faulthandler_fallback:
            self._fh_file = register_faulthandler(faulthandler_path(run, role, rank))
        self._recorder = None
        if role == "train" and config.collective_trace_entries > 0:
            from rlslurm.diag.collectives import serve

            self._recorder = serve(run, role, rank, config.collective_trace_entries)
        self.heartbeat.update(phase="start", phase_timeout_s=config.timeout_for("start"), force=True)

    @property
    def drain_requested(self) -> bool:
        return bool(self.gate is not None and self.gate.requested)

    def phase(self, name: str, step: int | None = None) -> "_Phase":
        """Run the body as phase `name` of `step`: heartbeat now, drain check at both ends, failures recorded."""
        return _Phase(self, name, step)

    def _record_failure(self, name: str, step: int | None, e: BaseException) -> None:
        if getattr(e, "_rlslurm_recorded", False):  # nested phases: record once, at the innermost
            return
        try:
            e._rlslurm_recorded = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        emit(self.run, PHASE_FAILED, role=self.role, rank=self.rank, phase=name, step=step,
             error=f"{type(e).__name__}: {e}", traceback=tb)
        self.heartbeat.update(progress=False, state="failed", error=f"{type(e).__name__}: {e}", force=True)

    def close(self, ok: bool = True) -> None:
        """Mark the heartbeat exited (or failed) so the watchdog stops watching this process."""
        state = "exited" if ok else "failed"
        if self.heartbeat.record.get("state") == "failed":
            state = "failed"
        self.heartbeat.update(progress=False, state=state, phase=None)
        self.heartbeat.close()
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self._fh_file is not None:
            faulthandler.unregister(FAULTHANDLER_SIGNAL)
            self._fh_file.close()
            self._fh_file = None

    def __enter__(self) -> "PhaseGuard":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


class _Phase:
    """One `with guard.phase(name, step)`: a plain class, not a contextlib generator (half the frames)."""

    __slots__ = ("guard", "name", "step", "timeout_s")

    def __init__(self, guard: PhaseGuard, name: str, step: int | None):
        self.guard, self.name, self.step = guard, name, step

    def __enter__(self) -> PhaseGuard:
        guard = self.guard
        if guard.gate is not None:
            guard.gate.check()
        timeout_s = guard._timeouts.get(self.name)
        if timeout_s is None:
            timeout_s = guard._timeouts[self.name] = guard.config.timeout_for(self.name)
        self.timeout_s = timeout_s
        guard._stack.append(self)
        guard.heartbeat.enter(self.name, self.step, timeout_s, True)
        return guard

    def __exit__(self, exc_type, exc, tb) -> bool:
        guard = self.guard
        if exc is not None and not isinstance(exc, GeneratorExit):
            guard._record_failure(self.name, self.step, exc)
        stack = guard._stack
        stack.pop()
        # Back in the outer phase (or between phases): not written now, the next beat or phase does it.
        if stack:
            outer = stack[-1]
            guard.heartbeat.enter(outer.name, outer.step, outer.timeout_s, False)
        else:
            guard.heartbeat.enter(None, self.step, guard._timeouts[None], False)
        if exc is None and guard.gate is not None:
            guard.gate.check()
        return False

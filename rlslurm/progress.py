"""The live progress line of a run, read from what its ranks append to the run directory.

    progress = Progress(run, total_steps=job.train.steps)
    line = progress.poll()   # None until the run recorded something new since the last poll, else e.g.
    # step 12/60 20% | 1.93 s/step: rollout 36% reward 11% train 42% sync 7% | reward 0.410 | 28.3 eff. samples/s
    #   | held-out 0.530 (step 10) | ETA 1m33s | restart 1 | resumed from step-00000010

`rlslurm submit --wait` prints it through `LinePrinter` (rewritten in place on a terminal; elsewhere a
new line when it changed, at most every `every_s`), and `rlslurm status` shows the latest. Both files are
read incrementally (`JsonlTail`: only the bytes appended since the last poll; a half-written last line
waits for the next), so following a long run costs a read of what it added; their new lines are taken in
the order of their times `t`. One line shape per kind of
run: RL steps (`policy_version` in the record), SFT steps (`kind: sft_step`), the toy job (`loss`).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import TextIO

from rlslurm import events
from rlslurm.rundir import JsonlTail, RunDir, current_names

PHASES = ("rollout", "reward", "train", "sync")
# Events that change what a reader should know about the run, as the line's last part says them.
NOTABLE = {
    events.RESUME: "resumed from {checkpoint}",
    events.EXPERIENCE_RESTORED: "experience of steps {steps} restored",
    events.DRAIN_REQUESTED: "draining: {reason}",
    events.DRAINED: "drained at step {step}: {reason}",
    events.HANG_DETECTED: "hang detected: {message}",
    events.HANG_ACTION: "hang: {action}",
    events.REQUEUE: "requeued",
    events.REQUEUE_FAILED: "requeue failed: {error}",
    events.STEP_ABANDONED: "step {step} abandoned: {reason}",
    events.SYNC_FAILED: "weight sync failed at version {version}",
    events.SYNC_VERIFY_FAILED: "weight sync to version {version} failed VERIFY on {engine}",
    events.SYNC_SKIPPED: "weight sync skipped at step {step}",
    events.ENGINE_FAILED: "engine {url} failed: {cause}",
    events.REWARD_DEGRADED: "step {step}: {degraded}/{total} rewards degraded",
    events.REWARD_SERVICE_DIED: "reward service died",
    events.REWARD_SERVICE_RESTARTED: "reward service restarted",
    events.REWARD_SERVICE_DOWN: "reward service down after {restarts} restarts (reward.max_restarts {max_restarts})",
    events.CHECKPOINT_SKIPPED: "checkpoint {checkpoint} skipped: {reason}",
    events.CHECKPOINT_FAILED: "checkpoint of step {step} failed: {error}",
    events.CHECKPOINT_SAVE_SKIPPED: "checkpoint of step {step} skipped after {attempts} tries ({failed_saves} in a "
                                    "row, checkpoint.max_failed_saves {max_failed_saves}); newest: {newest_complete}",
    events.ENGINE_DOWN: "engine {engine} down past rollout.max_restarts {max_restarts}: out of rotation, the others "
                        "serve on",
    events.JOB_SIGTERM: "SIGTERM from SLURM: every rank and role drains",
    events.PHASE_FAILED: "failed in {phase}: {error}",
    events.NO_PROGRESS: "stopped: no progress over restarts",
    events.DONE: "done",
    events.SFT_FINISHED: "done",
}


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _after_drain(requeued) -> str:
    """What comes after a drain, as its event recorded it: requeued by this job, or whose move it is."""
    if requeued is True:
        return "requeued: it resumes by itself"
    if isinstance(requeued, str) and requeued.startswith("not by this job"):
        return "back only if SLURM requeues it, else `rlslurm resume`"
    return "not requeued: `rlslurm resume` continues it"


def _event_note(event: dict) -> str:
    fields = defaultdict(lambda: "?", {k: v for k, v in event.items() if v is not None})
    note = NOTABLE[events.kind_of(event)].format_map(fields)
    if events.kind_of(event) == events.DRAINED:  # who brings it back: read from its `requeued`, not a template field
        note += f" ({_after_drain(event.get('requeued'))})"
    return note


class Progress:
    """Follows one run directory; `poll()` returns the new progress line, or None if nothing changed."""

    def __init__(self, run: RunDir, total_steps: int | None = None, window: int = 20):
        self.run, self.total_steps = run, total_steps
        self.metrics = JsonlTail(run.metrics)
        self.events = JsonlTail(run.events)
        self.step_s: deque[float] = deque(maxlen=window)
        self.last: dict | None = None
        self._rate_from: dict | None = None  # the record a `t`-difference rate is measured from
        self.evaluated: tuple[int, float] | None = None  # (step, held-out accuracy)
        self.note: str | None = None
        self.finished = False  # the newest job emitted one of events.FINISHED: it trained to the end
        self.last_event: str | None = None
        self._shown: str | None = None
        self._failure_said = False  # this start's first phase_failed is the cause; later ones are its echoes

    def _take(self, record: dict) -> None:
        record = current_names(record)  # an old SFT run spelled it heldout_accuracy
        if record.get("kind") == "sft_eval":
            if "held_out_accuracy" in record:  # SFT on a user's dataset records a held-out loss instead
                self._evaluated(record, record["held_out_accuracy"])
            return
        if "step" not in record or record.get("final") or not ("policy_version" in record or "loss" in record):
            return
        if self.last is not None and record["step"] <= self.last["step"]:
            self._restart_rate()  # steps made again after a resume from an older checkpoint
        since = self._rate_from
        if "step_s" in record:
            self.step_s.append(record["step_s"])
        elif since is not None and "t" in record and "t" in since and record["step"] > since["step"]:
            self.step_s.append((record["t"] - since["t"]) / (record["step"] - since["step"]))
        if "held_out_accuracy" in record:
            self._evaluated(record, record["held_out_accuracy"])
        self.last = self._rate_from = record

    def _restart_rate(self) -> None:
        """A new start: its steps' pace is its own (the gap of a requeue is no step's time)."""
        self.step_s.clear()
        self._rate_from = None

    def _evaluated(self, record: dict, accuracy: float) -> None:
        self.evaluated = (record.get("step", 0), accuracy)

    def _event(self, event: dict) -> None:
        self.last_event = event.get("kind")
        kind = events.kind_of(event)  # None for a kind declared no more (an older run directory)
        if kind == events.EVAL and "held_out_accuracy" in event:
            self._evaluated(event, event["held_out_accuracy"])
        if kind in (events.SUBMITTED, events.START, events.RESUME):
            self._restart_rate()
            self._failure_said = False
        if kind in (events.SUBMITTED, *events.FINISHED):
            self.finished = kind in events.FINISHED
        if kind == events.PHASE_FAILED:
            # The first rank to fail names the cause (rank 0's PermissionError); its peers' failures after it are
            # echoes ("Connection closed by peer" of gloo on rank 1, issue 38) and do not replace it.
            if self._failure_said:
                return
            self._failure_said = True
        if kind in NOTABLE:
            self.note = _event_note(event)
        elif kind in (events.SUBMITTED, events.START):  # a new job or start: the last one's word is history
            self.note = None

    def poll(self) -> str | None:
        # Both files' new lines in the order they were written (every record and event has its time `t`).
        new = [(r.get("t", 0.0), 0, r) for r in self.metrics.read()]
        new += [(e.get("t", 0.0), 1, e) for e in self.events.read()]
        for _, is_event, item in sorted(new, key=lambda x: x[:2]):
            if is_event:
                self._event(item)
            else:
                self._take(item)
        line = self.line()
        if line == self._shown:
            return None
        self._shown = line
        return line

    def line(self) -> str:
        """The line for what was read so far."""
        if self.last is None:
            parts = [f"no step yet (last event: {self.last_event or 'none'})"]
        else:
            parts = self._step_parts(self.last)
        if self.note:
            parts.append(self.note)
        return " | ".join(parts)

    def _step_parts(self, r: dict) -> list[str]:
        step, total = r["step"], self.total_steps
        head = f"step {step}/{total} {100 * step // total}%" if total else f"step {step}"
        rate = sum(self.step_s) / len(self.step_s) if self.step_s else None
        parts = [head]
        if "policy_version" in r:  # RL
            split = ""
            if all(f"{p}_share" in r for p in PHASES):
                split = ": " + " ".join(f"{p} {100 * r[f'{p}_share']:.0f}%" for p in PHASES)
            parts.append(f"{rate:.2f} s/step{split}" if rate is not None else split.lstrip(": "))
            parts.append(f"reward {r['reward_mean']:.3f}" if "reward_mean" in r else "")
            parts.append(f"{r['effective_samples_per_s']:.1f} eff. samples/s" if "effective_samples_per_s" in r else "")
            if r.get("staleness_max"):
                parts.append(f"staleness <= {r['staleness_max']}")
            if r.get("reward_degraded_ratio"):
                parts.append(f"rewards degraded {100 * r['reward_degraded_ratio']:.1f}%")
        else:  # SFT or the toy job
            parts.append(f"loss {r['loss']:.4f}")
            if "lr" in r:
                parts.append(f"lr {r['lr']:.2e}")
            if rate is not None:
                parts.append(f"{rate:.3f} s/step")
        if self.evaluated is not None:
            parts.append(f"held-out {self.evaluated[1]:.3f} (step {self.evaluated[0]})")
        if rate is not None and total and step < total:
            parts.append(f"ETA {_duration(rate * (total - step))}")
        if r.get("restart_count"):
            parts.append(f"restart {r['restart_count']}")
        return [p for p in parts if p]


class LinePrinter:
    """Shows successive progress lines: in place on a terminal; elsewhere (a log, CI) each as a new line,
    at most one per `every_s` unless `final`."""

    def __init__(self, stream: TextIO, every_s: float = 10.0, clock=time.monotonic):
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.tty = stream.isatty()
        self._printed_at: float | None = None
        self._pending: str | None = None
        self._open = False

    def show(self, line: str | None, *, final: bool = False) -> None:
        if line is not None:
            self._pending = line
        if self._pending is None:
            return
        now = self.clock()
        if self.tty:
            self.stream.write("\r\033[K" + self._pending + ("\n" if final else ""))
            self._open = not final
        elif final or self._printed_at is None or now - self._printed_at >= self.every_s:
            self.stream.write(self._pending + "\n")
        else:
            return
        self.stream.flush()
        self._printed_at, self._pending = now, None

    def close(self) -> None:
        """End an in-place line (a terminal), so what follows starts on its own line."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

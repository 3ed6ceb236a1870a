"""Each RL step's prompts, drawn from the job's train rows (its data: files, or task:'s generated arithmetic)
in the seeded order of rlslurm/data/sampler.py; the data position a checkpoint saves and a resume goes on from.

    stream = PromptStream(train, per_step=16, seed=job.train.seed, max_bad_share=job.data.max_bad_share)
    stream.resume(step, rl_state.get("data"))     # the checkpoint's (epoch, index); none: step 0's position
    drawn = stream.draw(step)                     # StepPrompts: Samples, bad rows skipped and counted
    rl_state["data"] = stream.state(step)         # {epoch, index, rows, seed, drawn, bad} at boundary `step`

Step m takes positions p0 + (m - s0) * per_step onwards, (s0, p0) the step and position this start began at,
plus the rows earlier steps of this start drew beyond per_step (`draw_more`: rl.dynamic_sampling's extra
rounds): a function of the step and what the steps before it drew, whichever thread draws it and however far
ahead (rl.max_staleness; the producer draws steps in order, each one's rounds before the next step's), so a
resumed or requeued run draws exactly the rows the uninterrupted run drew: a checkpoint saves the position
after every row drawn before its boundary, and the experience it keeps made ahead says how many rows each of
those steps drew (`restored`). A bad row (RowError: a column
missing, a prompt of the wrong type) is skipped, not replaced, so positions stay a function of the step; it
is counted in the step's `data_bad_rows`, and past data.max_bad_share of the rows drawn so far the job stops
(BadRowShareError, rlslurm/data/table.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from rlslurm.data.layout import DataError, RowError
from rlslurm.data.sample import Sample
from rlslurm.data.sampler import Sampler
from rlslurm.data.table import BadRows, BadRowShareError, SampleTable, row_error
from rlslurm.errors import CheckpointError

__all__ = ["BadRowShareError", "PromptStream", "StepPrompts"]  # BadRowShareError: what draw() raises


@dataclass
class StepPrompts:
    """One step's prompts and where they came from."""

    samples: list[Sample]
    position: int
    """The step's first position in the stream (epoch * rows + index)."""
    rows: list[int] = field(default_factory=list)
    """Each sample's row in its file (as `datasets` counts, from 0)."""
    bad: int = 0
    """Rows drawn for the step and skipped: they broke the layout's rules."""
    first_reason: str | None = None


class PromptStream:
    """The train rows as a stream of steps; thread-safe (the pipeline's thread draws ahead of the loop)."""

    def __init__(self, train: SampleTable, *, per_step: int, seed: int, max_bad_share: float):
        self.table, self.per_step = train, per_step
        self.sampler = Sampler(len(train), seed)
        self.start_step, self.start_position = 0, 0
        self.counted = BadRows(max_bad_share)  # rows drawn and skipped before this start (the checkpoint's)
        self._steps: dict[int, tuple[int, int]] = {}  # step -> (drawn, bad) of the steps drawn in this start
        self._extra: dict[int, int] = {}  # step -> rows it drew beyond per_step (rl.dynamic_sampling)
        self._last: str | None = None
        self._lock = threading.Lock()

    def resume(self, step: int, saved: dict | None) -> None:
        """Go on at boundary `step`: from the position a checkpoint saved, or, with none (a fresh run, or a
        checkpoint written before the data position was saved), where step `step` of a fresh run starts."""
        position = step * self.per_step
        if saved:
            try:
                position = self.sampler.position(saved)
            except ValueError as e:
                raise CheckpointError(f"{self.table.source}: {e}; resume with the data (and train.seed) the run was "
                                      "started with, or start a new run") from None
            self.counted = BadRows(self.counted.max_share, int(saved.get("drawn", 0)), int(saved.get("bad", 0)))
        with self._lock:
            self.start_step, self.start_position, self._steps, self._extra = step, position, {}, {}

    def restored(self, step: int, bad: int, drawn: int | None = None) -> None:
        """Step `step`'s prompts came from a checkpoint's experience made ahead (rl.max_staleness), not from a
        draw in this start: their rows (`drawn`, default per_step) count as drawn here, as they did in the
        uninterrupted run, and the steps after it draw on from there."""
        drawn = self.per_step if drawn is None else int(drawn)
        with self._lock:
            self._steps[step] = (drawn, int(bad))
            self._extra[step] = drawn - self.per_step

    def position(self, step: int) -> int:
        with self._lock:
            extra = sum(n for m, n in self._extra.items() if self.start_step <= m < step)
        return self.start_position + (step - self.start_step) * self.per_step + extra

    def draw(self, step: int) -> StepPrompts:
        """Step `step`'s prompts; BadRowShareError past data.max_bad_share, DataError when none is left."""
        with self._lock:
            self._extra.pop(step, None)  # drawn again (a step made anew): its earlier rounds no longer count
        out = self._take(step, self.position(step), self.per_step, first=True)
        if not out.samples:
            raise DataError(f"step {step}: every one of its {self.per_step} rows broke the data layout's rules; the "
                            f"first: {out.first_reason}")
        return out

    def draw_more(self, step: int, count: int) -> StepPrompts:
        """`count` more prompts for step `step` (rl.dynamic_sampling's next round), from where its rows so far
        end; they count in the step's rows drawn and in the data position of every later step."""
        with self._lock:
            extra = self._extra.get(step, 0)
        out = self._take(step, self.position(step) + self.per_step + extra, count, first=False)
        with self._lock:
            self._extra[step] = extra + count
        return out

    def _take(self, step: int, position: int, count: int, *, first: bool) -> StepPrompts:
        out = StepPrompts([], position)
        for i in self.sampler.indices(position, count):
            got = self.table.try_sample(i)
            if isinstance(got, RowError):
                out.bad += 1
                reason = str(row_error(self.table.source, self.table.file_row(i), got))
                out.first_reason, self._last = out.first_reason or reason, reason
                continue
            out.samples.append(got)
            out.rows.append(self.table.file_row(i))
        with self._lock:
            drawn, bad = (0, 0) if first else self._steps.get(step, (0, 0))
            self._steps[step] = (drawn + count, bad + out.bad)
            total = BadRows(self.counted.max_share, self.counted.drawn, self.counted.bad, self._last)
            for drawn, bad in self._steps.values():
                total.drawn, total.bad = total.drawn + drawn, total.bad + bad
        total.add(0, 0)  # raises past the share
        return out

    def state(self, step: int) -> dict:
        """The data position at boundary `step` (the next row step `step` draws) and the rows counted before it."""
        with self._lock:
            before = [v for m, v in self._steps.items() if m < step]
        return {**self.sampler.state(self.position(step)), "drawn": self.counted.drawn + sum(d for d, _ in before),
                "bad": self.counted.bad + sum(b for _, b in before)}

"""The RL step's prompts as a stream of the train rows (rlslurm/rl/draw.py): a function of the step alone, a
resume at a saved (epoch, index) draws what the uninterrupted stream drew, bad rows are skipped and counted,
past data.max_bad_share the stream stops naming the last bad row, and a checkpoint of other data is refused."""

from __future__ import annotations

import pytest

from rlslurm.data.config import DataConfig
from rlslurm.data.layout import DataError, resolve
from rlslurm.data.source import from_rows
from rlslurm.data.table import SampleTable
from rlslurm.errors import CheckpointError
from rlslurm.rl.draw import BadRowShareError, PromptStream


def _table(n: int, bad: set[int] = frozenset()) -> SampleTable:
    rows = [{"prompt": f"{i}+1=", "ground_truth": None if i in bad else str(i + 1)} for i in range(n)]
    source = "data.train = t.jsonl"
    layout = resolve(DataConfig(train="t.jsonl", eval_fraction=0.1), ["prompt", "ground_truth"], source)
    return SampleTable(from_rows(rows), layout, source, frozenset({"reference"}))


def _stream(table: SampleTable, share: float = 1.0, per_step: int = 4) -> PromptStream:
    return PromptStream(table, per_step=per_step, seed=3, max_bad_share=share)


def test_steps_are_epochs_of_seeded_permutations_and_a_function_of_the_step():
    table = _table(10)
    stream = _stream(table)
    drawn = [stream.draw(s) for s in range(5)]  # 20 positions: two epochs of 10
    rows = [r for d in drawn for r in d.rows]
    assert sorted(rows[:10]) == list(range(10)) and sorted(rows[10:]) == list(range(10)) and rows[:10] != rows[10:]
    assert [s.prompt for s in drawn[2].samples] == [f"{r}+1=" for r in drawn[2].rows]
    ahead = _stream(table)
    assert ahead.draw(3).rows == drawn[3].rows, "a step drawn first (run-ahead) is the same step"
    assert stream.state(3) == {"epoch": 1, "index": 2, "rows": 10, "seed": 3, "drawn": 12, "bad": 0}


def test_a_resume_at_the_saved_position_draws_the_uninterrupted_rows():
    table = _table(10)
    straight = _stream(table)
    expected = [straight.draw(s).rows for s in range(6)]
    first = _stream(table)
    for s in range(3):
        first.draw(s)
    saved = first.state(3)
    resumed = _stream(table)
    resumed.resume(3, saved)
    assert [resumed.draw(s).rows for s in range(3, 6)] == expected[3:]
    # a checkpoint written before the data position: step * prompts_per_step
    legacy = _stream(table)
    legacy.resume(3, None)
    assert legacy.draw(3).rows == expected[3]


def test_a_checkpoint_of_other_data_or_seed_is_refused():
    saved = _stream(_table(10)).state(2)
    with pytest.raises(CheckpointError, match=r"data.train = t.jsonl: the checkpoint's data position is for 10 rows"):
        _stream(_table(12)).resume(2, saved)
    other_seed = PromptStream(_table(10), per_step=4, seed=4, max_bad_share=1.0)
    with pytest.raises(CheckpointError, match="under seed 3; this job has 10 rows under seed 4"):
        other_seed.resume(2, saved)


def test_bad_rows_are_skipped_counted_and_stop_the_run_past_the_share():
    table = _table(10, bad={2, 7})
    stream = _stream(table, share=1.0)
    drawn = [stream.draw(s) for s in range(5)]
    assert sum(d.bad for d in drawn) == 4 and all(2 not in d.rows and 7 not in d.rows for d in drawn)
    assert all(len(d.samples) + d.bad == 4 for d in drawn)
    reason = next(d.first_reason for d in drawn if d.bad)
    assert reason.startswith("data.train = t.jsonl: row ") and "column 'ground_truth'" in reason
    assert stream.state(5)["bad"] == 4 and stream.state(5)["drawn"] == 20
    # 2 of 10 rows are bad: a share of 0.1 is passed at the first step that draws one
    strict = _stream(table, share=0.1)
    first_bad = next(s for s, d in enumerate(drawn) if d.bad)
    for s in range(first_bad):
        strict.draw(s)
    with pytest.raises(BadRowShareError, match=r"of the \d+ training rows drawn so far broke the data layout's rules, "
                                               r"past data.max_bad_share = 0.1; the last: data.train = t.jsonl: row "):
        strict.draw(first_bad)
    # the counts a checkpoint saved go on counting after a resume
    resumed = _stream(table, share=0.1)
    resumed.resume(5, {**stream.state(5), "drawn": 1000, "bad": 4})
    resumed.draw(5)


def test_a_step_of_only_bad_rows_is_an_error():
    stream = _stream(_table(4, bad={0, 1, 2, 3}), share=1.0)
    with pytest.raises(DataError, match="step 0: every one of its 4 rows broke the data layout's rules"):
        stream.draw(0)


def test_steps_restored_from_a_checkpoints_experience_count_as_drawn():
    """With the rollout running ahead (rl.max_staleness), a checkpoint at boundary 3 carries step 3's experience:
    the resumed start does not draw step 3 again, yet its rows (and bad rows) count as in the uninterrupted run."""
    table = _table(10, bad={2, 7})
    stream = _stream(table)
    drawn = [stream.draw(s) for s in range(5)]
    resumed = _stream(table)
    resumed.resume(3, stream.state(3))
    resumed.restored(3, drawn[3].bad)
    resumed.draw(4)
    assert resumed.state(5) == stream.state(5)

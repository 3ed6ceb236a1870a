"""DAPO's dynamic sampling (rlslurm/rl/dynamic.py, rl.dynamic_sampling) and the data position it moves
(rlslurm/rl/draw.py's draw_more): zero-variance groups dropped and counted, rounds drawn until the step is
full (bounded, the surplus and the shortfall counted), and a resume at a saved position draws exactly the
rows the uninterrupted stream drew, extra rounds included.

    python -m pytest -q tests/unit/test_rl_dynamic.py      # ~2 s
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_rl_draw import _table

from rlslurm.rl.draw import PromptStream, StepPrompts
from rlslurm.rl.dynamic import Round, fill, merge, next_round_size
from rlslurm.rl.experience import GroupAssembler

K = 2


def _round(rewards: list[list[float]], start: int = 0) -> Round:
    """A round of len(rewards) prompts, K responses each, scored inline (as reward.service inline does)."""
    problems = [SimpleNamespace(prompt=f"p{start + i}") for i in range(len(rewards))]
    assembler = GroupAssembler(problems, K, lambda prompt: [1, 4])
    choices = [{"token_ids": [5, 2], "token_logprobs": [-0.1, -0.2], "policy_version": 0, "finish_reason": "stop",
                "prompt_index": g, "engine": 0, "index": g * K + j} for g in range(len(rewards)) for j in range(K)]
    assembler.add_choices(choices)
    assembler.add_rewards({f"0:{c['index']}": rewards[c["prompt_index"]][c["index"] % K] for c in choices})
    drawn = StepPrompts(problems, position=start, rows=list(range(start, start + len(rewards))))
    return Round(drawn, assembler, None, choices, [0.1])


MIXED, EQUAL = [1.0, 0.0], [0.0, 0.0]


def test_rounds_are_drawn_until_the_step_is_full_and_the_surplus_is_dropped():
    asked = []

    def next_round(index: int, count: int) -> Round:
        asked.append(count)
        return _round([MIXED] * count, start=100 * index)

    first = _round([MIXED, EQUAL, EQUAL, MIXED])  # 2 of 4 teach
    rounds = fill(first, per_step=4, max_rounds=4, next_round=next_round)
    assert asked == [4]  # 2 missing / (2 of 4 taught) = 4 prompts
    samples, versions, stats = merge(rounds, per_step=4, dynamic=True)
    assert len(samples) == 4 * K and versions == {0: 16}
    assert stats["ds_rounds"] == 2 and stats["ds_groups"] == 4 and stats["ds_short_groups"] == 0
    assert stats["zero_variance_groups"] == 2 and stats["ds_surplus_groups"] == 2
    assert stats["ds_prompts_drawn"] == 8 and stats["data_rows_drawn"] == 8 and stats["samples"] == 16


def test_the_rounds_are_bounded_and_a_short_step_is_counted():
    rounds = fill(_round([EQUAL] * 4), per_step=4, max_rounds=3,
                  next_round=lambda index, count: _round([EQUAL] * (count - 1) + [MIXED], start=10 * index))
    assert len(rounds) == 3
    samples, _, stats = merge(rounds, per_step=4, dynamic=True)
    assert stats["ds_groups"] == 2 and stats["ds_short_groups"] == 2 and len(samples) == 2 * K
    assert stats["zero_variance_groups"] == 4 + 3 + 3


def test_without_dynamic_sampling_one_round_trains_on_the_groups_that_teach():
    samples, _, stats = merge([_round([MIXED, EQUAL, MIXED])], per_step=3, dynamic=False)
    assert len(samples) == 2 * K and stats["zero_variance_groups"] == 1 and "ds_rounds" not in stats


@pytest.mark.parametrize("teaching,drawn,expected", [(0, 8, 8), (2, 8, 8), (4, 8, 8), (4, 4, 4), (6, 8, 3), (7, 8, 2)])
def test_the_next_round_asks_for_the_missing_groups_over_the_share_that_taught(teaching, drawn, expected):
    assert next_round_size(8, teaching, drawn) == expected


def test_extra_rounds_move_every_later_step_and_a_resume_draws_the_uninterrupted_rows():
    table = _table(10)
    straight = PromptStream(table, per_step=4, seed=3, max_bad_share=1.0)
    rows = {}
    for step in range(5):
        rows[step] = straight.draw(step).rows
        if step in (1, 3):  # dynamic sampling drew 3 more rows at these steps
            rows[step] += straight.draw_more(step, 3).rows
    everything = [r for step in range(5) for r in rows[step]]
    assert sorted(everything[:10]) == list(range(10)) and len(everything) == 26  # every row once an epoch
    assert straight.state(2)["drawn"] == 11 and straight.state(4)["drawn"] == 22

    first = PromptStream(table, per_step=4, seed=3, max_bad_share=1.0)
    for step in range(3):
        first.draw(step)
        if step == 1:
            first.draw_more(step, 3)
    saved = first.state(3)
    resumed = PromptStream(table, per_step=4, seed=3, max_bad_share=1.0)
    resumed.resume(3, saved)
    got = resumed.draw(3).rows + resumed.draw_more(3, 3).rows
    assert got == rows[3] and resumed.draw(4).rows == rows[4]
    assert resumed.state(4)["drawn"] == 22


def test_a_step_restored_from_a_checkpoints_buffer_counts_its_extra_rows():
    table = _table(10)
    straight = PromptStream(table, per_step=4, seed=3, max_bad_share=1.0)
    for step in range(3):
        straight.draw(step)
    straight.draw_more(2, 5)
    expected = straight.draw(3).rows
    resumed = PromptStream(table, per_step=4, seed=3, max_bad_share=1.0)
    resumed.resume(2, straight.state(2))
    resumed.restored(2, 0, drawn=9)  # step 2 came from the checkpoint's experience made ahead: 9 rows
    assert resumed.draw(3).rows == expected

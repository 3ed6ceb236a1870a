"""DAPO's dynamic sampling on the demo (rl.dynamic_sampling, rlslurm/rl/dynamic.py): GRPO from the SFT export,
where many groups of 8 are all right or all wrong. Zero-variance groups are dropped and counted, more prompts
are drawn until every step holds rl.prompts_per_step groups that teach, and a run stopped at a checkpoint
and resumed (experience made ahead included: rl.max_staleness 1) makes the steps, and draws the data rows,
the uninterrupted run made.

    python -m pytest -q tests/integration/test_rl_dynamic_sampling.py     # ~4-6 min on 2 cores (SFT first)
"""

from __future__ import annotations

import shutil

import pytest

from rl_runs import steps, submit_example, trajectory

pytestmark = pytest.mark.slow  # real SFT + RL runs: minutes on 2 cores

PER_STEP, K = 16, 8
SETTINGS = ("rl.dynamic_sampling=true", f"rl.prompts_per_step={PER_STEP}", "rl.eval_every=100", "rl.eval_rows=50",
            "checkpoint.interval_steps=2")


def test_every_step_is_full_and_the_dropped_groups_are_counted(sft, tmp_path):
    _, run_dir = submit_example("tiny-grpo.yaml", tmp_path,
                                (f"train.init_from={sft['export']}", "train.steps=4", "rl.max_staleness=0",
                                 *SETTINGS))
    lines = steps(run_dir)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    for r in lines:
        assert r["ds_groups"] == PER_STEP and r["ds_short_groups"] == 0, r
        assert r["effective_samples"] == PER_STEP * K
        # every prompt drawn is a group: those that teach, those left out, and the last round's surplus
        assert r["ds_prompts_drawn"] == PER_STEP + r["zero_variance_groups"] + r["ds_surplus_groups"]
        assert r["samples"] == r["ds_prompts_drawn"] * K and len(r["data_rows"]) == r["ds_prompts_drawn"]
    assert sum(r["zero_variance_groups"] for r in lines) > 0 and max(r["ds_rounds"] for r in lines) >= 2
    rows = [row for r in lines for row in r["data_rows"]]
    assert len(rows) == len(set(rows)), "no row drawn twice within the epoch"


def test_a_resumed_run_draws_and_trains_what_the_uninterrupted_run_did(sft, tmp_path):
    """Resumed from the uninterrupted run's checkpoint at step 4, which keeps step 5's experience made ahead
    (rl.max_staleness 1, with its extra rounds' rows): steps 5 and 6, their data rows included, are the
    uninterrupted run's (step 6 draws from where step 5's rounds ended)."""
    from rlslurm.events import read_events
    from rlslurm.rundir import RunDir
    from test_rl_overlap import _start_ranks

    _, whole = submit_example("tiny-grpo.yaml", tmp_path / "whole",
                              (f"train.init_from={sft['export']}", "train.steps=6", "rl.max_staleness=1", *SETTINGS))
    run = RunDir(tmp_path / "resumed").create()
    for name in ("config.yaml", "layout.json"):
        shutil.copy(whole / name, run.path / name)
    shutil.copytree(whole / "checkpoints" / "step-00000004", run.path / "checkpoints" / "step-00000004")
    procs = _start_ranks(run.path)
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], "".join((tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(2))
    (restored,) = read_events(run, "experience_restored")
    assert restored["steps"] == [4]  # step 5 (index 4 of the schedule) came from the checkpoint
    ours = {r["step"]: r for r in steps(run.path)}
    theirs = {r["step"]: r for r in steps(whole)}
    assert sorted(ours) == [5, 6]
    assert trajectory(run.path) == {s: t for s, t in trajectory(whole).items() if s > 4}
    for step in (5, 6):
        assert (ours[step]["data_rows"], ours[step]["data_index"]) == (theirs[step]["data_rows"],
                                                                       theirs[step]["data_index"])
    assert any(len(theirs[s]["data_rows"]) > PER_STEP for s in (1, 2, 3, 4, 5)), \
        "an earlier step drew an extra round: step 6, drawn after the resume, starts where the rounds ended"

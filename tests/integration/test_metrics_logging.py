"""`logging:` on real runs: `rlslurm submit examples/tiny-grpo.yaml --backend local` for 4 steps (random init,
one engine server, broadcast sync over gloo) and a 40-step SFT of examples/tiny-sft.yaml, with
logging.tensorboard: true, read back by TensorBoard's own EventAccumulator; and, where the wandb package is
installed (it is not in the dev extra), a 2-step RL run's offline W&B files.

    python -m pytest -q tests/integration/test_metrics_logging.py   # ~2-3 min on 2 loaded cores
"""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl_runs import steps, submit_example
from rlslurm.metrics_sinks import numeric
from rlslurm.rundir import read_jsonl

SMALL = ("train.steps=4", "rl.prompts_per_step=8", "rl.samples_per_prompt=4", "rl.eval_every=2",
         "task.eval_size=16", "checkpoint.interval_steps=1000")


def test_tensorboard_event_files_hold_every_step_of_metrics_jsonl(tmp_path):
    _, run_dir = submit_example("tiny-grpo.yaml", tmp_path, (*SMALL, "logging.tensorboard=true"))
    recorded = steps(run_dir)
    assert [r["step"] for r in recorded] == [1, 2, 3, 4]
    board = run_dir / "tensorboard"
    assert list(board.glob("events.out.tfevents.*")), f"no event file in {board}"
    events = EventAccumulator(str(board), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    tags = set(events.Tags()["scalars"])
    # The same names as metrics.jsonl: every numeric field of every step line.
    assert set().union(*(numeric(r) for r in recorded)) == tags
    for name in ("reward_mean", "loss", "step_s", "held_out_accuracy"):
        jsonl = {r["step"]: r[name] for r in recorded if name in r}
        board_points = {e.step: e.value for e in events.Scalars(name)}
        assert board_points == pytest.approx(jsonl, rel=1e-6), name  # float32 in the event file
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]
    assert not (run_dir / "wandb").exists()  # off unless asked


def test_sft_steps_and_its_evaluation_reach_tensorboard(tmp_path):
    _, run_dir = submit_example("tiny-sft.yaml", tmp_path, ("train.steps=40", "task.eval_size=16",
                                                            "logging.tensorboard=true"))
    lines = read_jsonl(run_dir / "metrics.jsonl")
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    jsonl = {r["step"]: r["loss"] for r in lines if r.get("kind") == "sft_step"}
    assert len(jsonl) == 40
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx(jsonl, rel=1e-6)
    (evaluation,) = [r for r in lines if r.get("kind") == "sft_eval"]
    assert [(e.step, e.value) for e in events.Scalars("held_out_accuracy")] == [
        (evaluation["step"], pytest.approx(evaluation["held_out_accuracy"]))]


def test_wandb_offline_run_under_the_run_directory(tmp_path):
    import wandb  # noqa: F401 - in the dev extra: this test runs wherever the suite does, never skipped
    _, run_dir = submit_example("tiny-grpo.yaml", tmp_path, (*SMALL, "train.steps=2", "logging.wandb=true",
                                                             "logging.wandb_project=rlslurm-test"))
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (history,) = offline.glob("run-*.wandb")
    # The offline log is protobuf records: the metric names metrics.jsonl uses are in it, as `wandb sync` sends them.
    data = history.read_bytes()
    assert b"reward_mean" in data and b"sync_update_gbps" in data and b"rlslurm-test" in data
    assert len(steps(run_dir)) == 2  # metrics.jsonl keeps every step either way

"""GRPO on a user's verl-layout parquet (examples/grpo-verl.yaml) as a het job on the real local cluster: the
trainer on a `train` node, the engine on a `rollout` node; drained mid-run with `rlslurm drain`, requeued by
itself, and resumed at the same next row: every step, before the drain and after it, trains on exactly the rows
an uninterrupted run draws at that step (the stream is a function of train.seed and the step alone, so the
expected rows are computed here from the data, no reference run needed), scored by the example's own reward
(`reward.scorer: function`: its verl-style compute_score in the reward service's workers). ~2 min on 2 shared
cores (cluster start and the session's short SFT included). The rule scorer on data rows: test_rl_data.py.

    RLSLURM_SLURM_PORT_BASE=21817 python -m pytest -q -s tests/cluster/test_rl_data_slurm.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import spine_util as su
from rlslurm.checkpoint import latest_complete
from rlslurm.cli.main import cli
from rlslurm.config import load_config
from rlslurm.data.splits import load_splits
from rlslurm.rl.draw import PromptStream
from rlslurm.rundir import RunDir, read_jsonl

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
JOB_TIMEOUT_S = 240
"""Bound on one RL job, its requeue included (test_rl_slurm.py measured 36-45 s with a requeue)."""


@pytest.fixture(scope="module")
def verl_data(tmp_path_factory) -> tuple[Path, Path]:
    spec = importlib.util.spec_from_file_location("make_examples", ROOT / "examples" / "data" / "make_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_verl_parquet(tmp_path_factory.mktemp("verl-data"))


def verl_config(path: Path, run_root: Path, init_from: Path, data: tuple[Path, Path], reward: dict) -> Path:
    """examples/grpo-verl.yaml as a het job on the local cluster: 1 train node (2 ranks) + 1 rollout node."""
    config = yaml.safe_load((ROOT / "examples" / "grpo-verl.yaml").read_text())
    config["job"]["name"] = path.stem
    config["hardware"] = {"profile": "cpu", "nodes": 2, "gpus_per_node": 2}
    config["train"].update(steps=STEPS, init_from=str(init_from))
    config["rl"].update(prompts_per_step=8, samples_per_prompt=4, eval_every=100, eval_rows=20)
    config["data"].update(train=str(data[0]), eval=str(data[1]))
    config["reward"] = reward
    config["sync"] = {"method": "broadcast"}
    config["checkpoint"] = {"interval_steps": su.INTERVAL, "kill_wait_s": su.KILL_WAIT_S, "cost_s": 0.5}
    config["cluster"] = {"backend": "slurm", "time_limit_min": 5, "run_root": str(run_root)}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def steps(run: Path) -> list[dict]:
    return [m for m in read_jsonl(RunDir(run).metrics) if "policy_version" in m]


def drain_and_resume(slurm_cluster, config: Path) -> tuple[Path, int]:
    """Submit, drain with `rlslurm drain <jobid>` after step 3, wait for the requeued job to finish."""
    sub = su.submit(config)
    run = sub.run_dir
    su.wait_for("RL step 3", lambda: max((m["step"] for m in steps(run)), default=0) >= 3, JOB_TIMEOUT_S)
    result = CliRunner().invoke(cli, ["drain", sub.job_id, "--run-root", str(run.parent), "--reason", "test"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    su.wait_done(sub.job_id, run, JOB_TIMEOUT_S, slurm_cluster.kick)
    (drained,) = su.events(run, "drained")
    return run, drained["step"]


def assert_same_rows_as_uninterrupted(run: Path, drained_at: int) -> None:
    """Every step's rows are those the stream draws at that step; the first step after the resume starts at the
    data position the drain checkpoint saved."""
    job = load_config(RunDir(run).config)
    stream = PromptStream(load_splits(job)[0], per_step=8, seed=job.train.seed, max_bad_share=1.0)
    expected = {s: stream.draw(s - 1).rows for s in range(1, STEPS + 1)}
    by_step = {m["step"]: m for m in steps(run)}  # a step made again after the resume keeps its last line
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert {s: m["data_rows"] for s, m in by_step.items()} == expected
    assert 3 <= drained_at < STEPS
    # (the drain's checkpoint is gone by now: checkpoint.keep; the last one says where a longer run goes on)
    state = latest_complete(RunDir(run)).load_json("rl_state")
    assert (state["step"], state["data"]["epoch"], state["data"]["index"]) == (STEPS, *divmod(STEPS * 8, 400))
    (resume,) = su.events(run, "resume")
    assert resume["step"] == drained_at
    # a het job: the engine ran in the rollout component, on a node of its own, in both starts
    rollout, train = su.placements(run, "rollout"), su.placements(run, "train")
    assert {p["restart_count"] for p in rollout} == {0, 1}
    assert not {p["node"] for p in rollout} & {p["node"] for p in train}
    after = min(m["step"] for m in steps(run) if m["restart_count"] == 1)
    assert after == drained_at + 1 and by_step[after]["data_index"] == drained_at * 8 % 400


def test_verl_het_job_with_its_compute_score_drains_and_resumes(slurm_cluster, sft_export, verl_data, tmp_path):
    config = verl_config(tmp_path / "verl-function.yaml", tmp_path / "runs", sft_export, verl_data,
                         {"scorer": "function", "service": "local", "batch_size": 32,
                          "function": f"{ROOT / 'examples' / 'data' / 'verl_reward.py'}:compute_score"})
    run, step = drain_and_resume(slurm_cluster, config)
    assert_same_rows_as_uninterrupted(run, step)
    assert any(m["reward_mean"] > 0 for m in steps(run))
    print(f"\nMEASURE verl het job with its compute_score, drained at step {step} and resumed")

"""A multi-turn run with tools as a het job on the real local cluster (trainer on a `train` node, the engine on a
`rollout` node, every episode's turns and the calculator's answers between them), drained in the middle with
`rlslurm drain`, requeued by itself and resumed at the same next row: every step, before the drain and after it,
draws exactly the rows an uninterrupted run draws at that step, and every step counts every one of its episodes
whole (the step in flight at the drain finished before the checkpoint; none is counted twice or by half).

    RLSLURM_SLURM_PORT_BASE=21817 python -m pytest -q -s tests/cluster/test_rl_tools_slurm.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import spine_util as su
from rlslurm.cli.main import cli
from rlslurm.config import load_config
from rlslurm.data.splits import load_splits
from rlslurm.rl.draw import PromptStream
from rlslurm.rundir import RunDir, read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from tool_fixtures import call, scripted_model  # noqa: E402

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
PROMPTS, SAMPLES = 8, 4
ROWS = 400
JOB_TIMEOUT_S = 300


def conversation(a: int, b: int) -> list[dict]:
    """Two tool calls, then the answer: (a + b) * 2."""
    return [{"role": "assistant", "content": "", "tool_calls": [call("calculator", expression=f"{a}+{b}")]},
            {"role": "tool", "name": "calculator", "content": str(a + b)},
            {"role": "assistant", "content": "", "tool_calls": [call("calculator", expression=f"{a + b}*2")]},
            {"role": "tool", "name": "calculator", "content": str((a + b) * 2)},
            {"role": "assistant", "content": str((a + b) * 2)}]


QUESTIONS = {f"add {a} {b} double": (a, b) for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))}


def steps(run: Path) -> list[dict]:
    return [m for m in read_jsonl(RunDir(run).metrics) if "policy_version" in m]


def test_multi_turn_het_job_drains_mid_run_and_resumes_at_the_same_row(slurm_cluster, tmp_path):
    model = scripted_model(tmp_path / "model", {q: conversation(a, b) for q, (a, b) in QUESTIONS.items()})
    questions = list(QUESTIONS)
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(ROWS):
            q = questions[i % len(questions)]
            a, b = QUESTIONS[q]
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "ground_truth": str((a + b) * 2)}) + "\n")
    config = yaml.safe_load((ROOT / "examples" / "tool-grpo.yaml").read_text())
    config["job"]["name"] = "tools-het"
    config["hardware"] = {"profile": "cpu", "nodes": 2, "gpus_per_node": 2}
    config["parallel"] = {"micro_batch_size": 16}
    config["train"].update(steps=STEPS, init_from=str(model))
    config["rl"].update(prompts_per_step=PROMPTS, samples_per_prompt=SAMPLES, eval_every=100, eval_rows=8)
    config["rollout"].update(max_new_tokens=96, temperature=0.7, max_turns=4)
    config["data"].update(train=str(tmp_path / "train.jsonl"), eval=str(tmp_path / "train.jsonl"))
    config["sync"] = {"method": "broadcast"}
    config["checkpoint"] = {"interval_steps": su.INTERVAL, "kill_wait_s": su.KILL_WAIT_S, "cost_s": 0.5}
    config["cluster"] = {"backend": "slurm", "time_limit_min": 5, "run_root": str(tmp_path / "runs")}
    path = tmp_path / "tools-het.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    sub = su.submit(path)
    run = sub.run_dir
    su.wait_for("RL step 3", lambda: max((m["step"] for m in steps(run)), default=0) >= 3, JOB_TIMEOUT_S)
    result = CliRunner().invoke(cli, ["drain", sub.job_id, "--run-root", str(run.parent), "--reason", "test"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    su.wait_done(sub.job_id, run, JOB_TIMEOUT_S, slurm_cluster.kick)
    (drained,) = su.events(run, "drained")
    at = drained["step"]
    (resume,) = su.events(run, "resume")
    assert resume["step"] == at and 3 <= at < STEPS

    job = load_config(RunDir(run).config)
    stream = PromptStream(load_splits(job)[0], per_step=PROMPTS, seed=job.train.seed, max_bad_share=1.0)
    by_step = {m["step"]: m for m in steps(run)}  # a step made again after the resume keeps its last line
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert {s: m["data_rows"] for s, m in by_step.items()} == {s: stream.draw(s - 1).rows for s in by_step}
    after = min(m["step"] for m in steps(run) if m["restart_count"] == 1)
    assert after == at + 1 and by_step[after]["data_index"] == at * PROMPTS % ROWS
    for m in steps(run):  # every episode of every step counted, whole, in both starts
        assert m["samples"] == PROMPTS * SAMPLES
        assert m["episode_turns_mean"] > 1.5 and m["tool_calls"] >= PROMPTS * SAMPLES
        assert m["engine_trainer_logprob_gap"] < 1e-3
    rollout, train = su.placements(run, "rollout"), su.placements(run, "train")
    assert {p["restart_count"] for p in rollout} == {0, 1}
    assert not {p["node"] for p in rollout} & {p["node"] for p in train}
    print(f"\nMEASURE multi-turn het job drained at step {at}, resumed at row {by_step[after]['data_index']}; turns "
          f"per episode {[round(m['episode_turns_mean'], 2) for m in steps(run)]}")

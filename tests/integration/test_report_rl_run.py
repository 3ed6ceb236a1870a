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
from rlslurm.rundir import read_jsonl

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

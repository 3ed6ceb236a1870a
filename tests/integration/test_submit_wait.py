"""`rlslurm submit --wait` of a job whose rank fails: one clear message with the root cause, the log's last
lines and the next command, its own exit code, and no traceback of the CLI; `rlslurm status --follow` of a
job submitted without --wait: the progress line to its end, exit 0 when it finished and 10 when it did
not (the real local backend)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from rlslurm.errors import JobFailedError

ROOT = Path(__file__).resolve().parents[2]


def test_a_failed_job_under_wait_is_one_message_with_its_evidence(tmp_path):
    submit = subprocess.run(
        [sys.executable, "-m", "rlslurm.cli.main", "submit", str(ROOT / "examples" / "tiny-grpo.yaml"),
         "--backend", "local", "--run-root", str(tmp_path), "--set", f"train.init_from={tmp_path / 'nothing'}",
         "--wait"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert submit.returncode == JobFailedError.exit_code, submit.stdout + submit.stderr
    first, *rest = submit.stderr.strip().splitlines()
    assert first.startswith("rlslurm: error: job ") and " failed: RlslurmError: train.init_from = " in first
    assert any(line.strip().startswith("last lines of ") and line.rstrip().endswith("_log.err:") for line in rest)
    assert "rlslurm diag " in rest[-1]
    assert "Traceback (most recent call last)" not in first and "click" not in submit.stderr  # not the CLI's stack
    assert "no step yet (last event: " in submit.stdout  # the progress line while it waited

    run_dir = re.search(r"run directory: (\S+)", submit.stdout).group(1)
    follow = _cli("status", run_dir, "--follow")
    assert follow.returncode == JobFailedError.exit_code, follow.stdout + follow.stderr
    assert "ended (exited) without finishing" in follow.stderr and "rlslurm diag " in follow.stderr


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlslurm.cli.main", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_status_follow_shows_a_job_submitted_without_wait_to_its_end(tmp_path):
    submit = _cli("submit", str(ROOT / "examples" / "tiny-grpo.yaml"), "--backend", "local",
                  "--run-root", str(tmp_path), "--set", "train.steps=3")
    assert submit.returncode == 0, submit.stdout + submit.stderr
    run_dir = re.search(r"run directory: (\S+)", submit.stdout).group(1)
    assert f"follow: rlslurm status {run_dir} --follow" in submit.stdout
    follow = _cli("status", run_dir, "--follow")
    assert follow.returncode == 0, follow.stdout + follow.stderr
    lines = follow.stdout.splitlines()
    assert lines[-1] == "ended: exited"
    assert re.match(r"step 3/3 100% \| [0-9.]+ s/step: .* \| done$", lines[-2]), lines[-2]

"""`rlslurm resume`: a finished run trained on (train.steps raised) from its last checkpoint, through the
real CLI and the local backend, makes exactly the steps the uninterrupted run made; a run that still
beats, or a bad override, is refused with nothing submitted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rl_runs import ROOT, submit_example, trajectory
from rlslurm import launch
from rlslurm.errors import ConfigError, RlslurmError
from rlslurm.events import read_events
from rlslurm.rundir import RunDir, read_jsonl

SETTINGS = ("rl.max_staleness=0", "rl.eval_every=2")


def test_a_finished_run_resumed_for_more_steps_matches_the_uninterrupted_run(tmp_path):
    _, whole = submit_example("tiny-grpo.yaml", tmp_path / "whole", ("train.steps=6", *SETTINGS))
    _, run_dir = submit_example("tiny-grpo.yaml", tmp_path / "resumed", ("train.steps=4", *SETTINGS))
    first_job = read_jsonl(run_dir / "submissions.jsonl")[-1]["job_id"]

    resumed = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "resume", str(run_dir),
                              "--set", "train.steps=6", "--wait"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"run directory: {run_dir}" in resumed.stdout and "step 6/6 100%" in resumed.stdout

    run = RunDir(run_dir)
    (resume,) = read_events(run, "resume")
    assert (resume["step"], resume["checkpoint"]) == (4, "step-00000004")
    assert read_jsonl(run_dir / "submissions.jsonl")[-1]["resume_of"] == first_job
    assert [e["overrides"] for e in read_events(run, "config_changed")] == [["train.steps=6"]]
    ours, theirs = trajectory(run_dir), trajectory(whole)
    assert sorted(ours) == [1, 2, 3, 4, 5, 6]
    assert ours == theirs  # steps 5 and 6 made from the checkpoint as the uninterrupted run made them


def test_resume_refuses_a_live_run_and_a_bad_override_and_submits_nothing(tmp_path):
    _, run_dir = submit_example("tiny-grpo.yaml", tmp_path, ("train.steps=1", *SETTINGS))
    run = RunDir(run_dir)
    submissions = (run_dir / "submissions.jsonl").read_text()

    with pytest.raises(ConfigError, match="train.stepz"):
        launch.resume(str(run_dir), overrides=("train.stepz=3",))
    beat = run.heartbeats / "train-0.json"
    record = json.loads(beat.read_text())
    assert record["state"] == "exited"  # the finished run: resumable at once (the first test resumes it)
    # As a live rank's: a running state, a fresh beat, and a process that runs (this one; a dead pid's fresh
    # heartbeat no longer blocks a resume, rlslurm/diag/heartbeat.py gone_here).
    beat.write_text(json.dumps({**record, "state": "running", "written": time.time(), "pid": os.getpid(),
                                "pid_started": psutil.Process().create_time()}))
    with pytest.raises(RlslurmError, match=r"is not stopped: train-0 \(pid \d+ on .*\) beat .* rlslurm drain"):
        launch.resume(str(run_dir), overrides=("train.steps=3",))
    assert (run_dir / "submissions.jsonl").read_text() == submissions
    assert not read_events(run, "config_changed")
    assert Path(run.config).read_text().count("steps: 1") >= 1

"""The edges a user meets around a failure (issue 19, part 6), their pure parts: a failed heartbeat is no sign of
life for `rlslurm resume`; what `rlslurm status` says when SLURM gives no answer. The SLURM halves (a stopped
controller, an sbatch refusal) run against the real local Slurm in tests/cluster/test_failure_edges.py.
"""

from __future__ import annotations

import time

import pytest

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.diag.config import DiagConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.diag.heartbeat import read_heartbeats
from rlslurm.errors import SlurmCommandError
from rlslurm.rundir import RunDir
from rlslurm.slurm import parse
from rlslurm.status import Status, render, slurm_error_line

EXAMPLE = "examples/tiny-grpo.yaml"


def test_a_heartbeat_whose_state_is_failed_is_no_sign_of_life(tmp_path):
    run = RunDir(tmp_path / "run").create()
    job = load_config(EXAMPLE)
    with pytest.raises(RuntimeError), PhaseGuard(run, "train", 0, DiagConfig(collective_trace_entries=0),
                                                 faulthandler_fallback=False, background=False) as guard:
        with guard.phase("train", step=3):
            raise RuntimeError("loss is nan")
    (hb,) = read_heartbeats(run)
    assert hb["state"] == "failed" and time.time() - hb["written"] < 5  # a recent beat, its process's last word
    assert launch.signs_of_life(run, job, time.time()) is None


def test_a_recent_running_heartbeat_still_refuses(tmp_path):
    run = RunDir(tmp_path / "run").create()
    guard = PhaseGuard(run, "train", 0, DiagConfig(collective_trace_entries=0), faulthandler_fallback=False,
                       background=False)
    try:
        alive = launch.signs_of_life(run, load_config(EXAMPLE), time.time())
        assert alive is not None and alive.startswith("train-0 (pid ")
    finally:
        guard.heartbeat.close()


def test_slurmctld_not_knowing_a_job_is_an_answer_not_a_silence():
    assert parse.job_unknown("slurm_load_jobs error: Invalid job id specified\n")
    # scontrol requeue's answer (SLURM 22.05) for a job another party requeued a moment before.
    assert parse.already_pending("Job is pending execution for job 30000029\n")
    assert not parse.already_pending("slurm_load_jobs error: Invalid job id specified\n")
    assert not parse.job_unknown("slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n")


def test_status_says_slurm_did_not_answer_with_the_command_error_and_timeout(tmp_path):
    err = SlurmCommandError("`scontrol show job -o 12` exited 1: slurm_load_jobs error: Unable to contact slurm "
                            "controller (connect failure)")
    err.duration_s = 18.1
    line = slurm_error_line(err)
    assert line == ("no answer about this job: `scontrol show job -o 12` exited 1: slurm_load_jobs error: Unable to "
                    "contact slurm controller (connect failure) (after 18.1 s; timeout 30 s per SLURM command); the "
                    "lines below are the run directory's own (heartbeats, checkpoints, events)")
    text = render(Status(run_dir=tmp_path, job_id="12", backend="slurm", slurm_error=line, checkpoint="step-00000004"))
    assert f"SLURM: {line}\n" in text and "last complete checkpoint: step-00000004" in text

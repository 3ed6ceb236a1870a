"""The exit-code contract, the start record and no-progress guard, and the drain/requeue decisions."""

from __future__ import annotations

import pytest

from rlslurm.errors import SlurmCommandError
from rlslurm.events import read_events
from rlslurm.lifecycle import (
    SLURM_SIGTERM,
    ExitCode,
    finish_drain,
    leader_job_id,
    needs_requeue,
    on_start,
    restart_count,
)
from rlslurm.rundir import RunDir, read_jsonl


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir(tmp_path / "run").create()


def test_exit_codes_are_distinct_from_cli_errors_and_signal_deaths():
    assert [int(c) for c in ExitCode] == [0, 1, 75, 76, 77]
    assert [c.name for c in ExitCode if needs_requeue(c)] == ["HANG_DETECTED"]


def test_restart_count_and_leader_job_id_from_the_environment():
    assert restart_count({}) == 0
    assert restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert restart_count({"RLSLURM_RESTART_COUNT": "3", "SLURM_RESTART_COUNT": "2"}) == 3
    assert leader_job_id({}) is None
    assert leader_job_id({"SLURM_JOB_ID": "41"}) == "41"
    assert leader_job_id({"SLURM_JOB_ID": "43", "SLURM_JOB_ID_HET_GROUP_0": "42"}) == "42"
    assert leader_job_id({"SLURM_JOB_ID": "43", "RLSLURM_LEADER_JOB_ID": "40"}) == "40"


def test_first_start_then_resume_are_recorded(run):
    assert on_start(run, 0, step=0, checkpoint=None, max_no_progress_restarts=3, env={"SLURM_JOB_ID": "7"}).proceed
    assert on_start(run, 1, step=12, checkpoint="step-00000012", max_no_progress_restarts=3, env={}).proceed
    jobs = read_jsonl(run.jobs)
    assert [(j["job_id"], j["restart_count"], j["step"]) for j in jobs] == [("7", 0, 0), (None, 1, 12)]
    assert read_events(run, "start")[0]["step"] == 0
    (resume,) = read_events(run, "resume")
    assert (resume["step"], resume["checkpoint"], resume["restart_count"]) == (12, "step-00000012", 1)


def test_no_progress_guard_counts_starts_in_a_row_from_the_same_step(run):
    def start(n: int, step: int):
        return on_start(run, n, step=step, checkpoint=f"step-{step:08d}", max_no_progress_restarts=2, env={})

    assert start(0, 5).proceed and start(1, 5).proceed  # one fruitless start so far
    assert start(2, 9).proceed                          # progress resets the count
    assert start(3, 9).proceed
    decision = start(4, 9)
    assert (decision.proceed, decision.code, decision.fruitless_starts) == (False, ExitCode.NO_PROGRESS, 2)
    (event,) = read_events(run, "no_progress")
    assert "2 starts in a row resumed from step 9" in event["reason"]
    assert "max_no_progress_restarts = 2" in event["reason"]
    assert len(read_jsonl(run.jobs)) == 5  # the refused start is on record too


def _drain(run, **kw):
    calls = {"save": 0, "requeue": []}

    def save():
        calls["save"] += 1
        return "step-00000008"

    args = dict(step=8, reason="signal SIGUSR1", signal_name="SIGUSR1", save=save, cost_s=2.0,
                time_left_s=None, is_leader=True, requeue=calls["requeue"].append, env={"SLURM_JOB_ID": "12"})
    args.update(kw)
    return finish_drain(run, **args), calls


def test_usr1_drain_saves_and_requeues_through_the_leader(run):
    code, calls = _drain(run, env={"SLURM_JOB_ID": "13", "SLURM_JOB_ID_HET_GROUP_0": "12"})
    assert code == ExitCode.DRAINED and calls == {"save": 1, "requeue": ["12"]}
    assert read_events(run, "requeue")[0]["job_id"] == "12"
    (drained,) = read_events(run, "drained")
    assert (drained["checkpoint"], drained["requeued"], drained["signal"]) == ("step-00000008", True, "SIGUSR1")


def test_off_slurm_the_drain_saves_but_requeues_nothing(run):
    code, calls = _drain(run, env={})
    assert code == ExitCode.DRAINED and calls == {"save": 1, "requeue": []}
    assert read_events(run, "drained")[0]["requeued"].startswith("not under SLURM")


def test_sigterm_saves_when_kill_wait_allows_and_never_requeues_twice(run):
    code, calls = _drain(run, signal_name="SIGTERM", time_left_s=25.0)
    assert code == ExitCode.DRAINED and calls == {"save": 1, "requeue": []}
    assert read_events(run, "drained")[0]["requeued"] == SLURM_SIGTERM


def test_sigterm_without_time_for_a_save_relies_on_the_periodic_one(run):
    code, calls = _drain(run, signal_name="SIGTERM", time_left_s=2.5)  # < 2 s x 1.5
    assert code == ExitCode.DRAINED and calls == {"save": 0, "requeue": []}
    (skipped,) = read_events(run, "drain_checkpoint_skipped")
    assert "2.5 s of KillWait left" in skipped["reason"]
    assert read_events(run, "drained")[0]["checkpoint"] is None


def test_a_failed_requeue_fails_the_job_with_the_evidence(run):
    def refuse(job_id):
        raise SlurmCommandError(f"`scontrol requeue {job_id}` exited 1: Job is pending")

    code, _ = _drain(run, requeue=refuse)
    assert code == ExitCode.FAILED
    assert "Job is pending" in read_events(run, "requeue_failed")[0]["error"]
    assert read_events(run, "drained") == []


def test_other_ranks_save_with_the_leader_but_stay_quiet(run):
    code, calls = _drain(run, is_leader=False)
    assert code == ExitCode.DRAINED and calls == {"save": 1, "requeue": []}
    assert not run.events.exists()


def test_trainer_restarts_inside_the_allocation_have_their_own_budget_not_the_storm_guards(run):
    """A restart of the trainer ranks in the allocation (rlslurm/slurm/supervisor.py) is recorded and said, but
    the storm guard counts only starts across requeues: train.max_restarts bounds the others."""
    def start(n: int, step: int, trainer_restart: int = 0):
        env = {"RLSLURM_TRAINER_RESTART": str(trainer_restart)} if trainer_restart else {}
        return on_start(run, n, step=step, checkpoint=f"step-{step:08d}", max_no_progress_restarts=2, env=env)

    assert start(0, 5).proceed
    assert start(0, 5, trainer_restart=1).proceed and start(0, 5, trainer_restart=2).proceed  # not a storm
    assert start(1, 5).proceed                      # the requeue after them: one fruitless start so far
    assert start(1, 5, trainer_restart=1).proceed
    assert not start(2, 5).proceed                   # the second fruitless requeue is the storm, as before
    records = read_jsonl(run.jobs)
    assert [r.get("trainer_restart") for r in records] == [None, 1, 2, None, 1, None]
    assert [e.get("trainer_restart") for e in read_events(run, "resume")] == [None, 1, 2, None, 1]


def test_a_process_age_is_to_the_clock_tick_not_the_boot_times_second():
    """rlslurm/lifetime.py process_age_s (the first_step event's since_process_start_s): a child's age at its
    start is ~0, and it ages as the wall clock does."""
    import subprocess
    import sys
    import time

    from rlslurm.lifetime import process_age_s

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        young = process_age_s(child.pid)
        time.sleep(0.3)
        older = process_age_s(child.pid)
    finally:
        child.kill()
        child.wait()
    assert 0 <= young < 0.5 and 0.25 < older - young < 1.0, (young, older)

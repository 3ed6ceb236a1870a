"""The trainer supervisor's pure parts: srun's task reports (real captures) and the restart decision."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.slurm import parse
from rlslurm.slurm.supervisor import decide, first_death

OUT = Path(__file__).resolve().parent / "slurm_outputs"


def ends(name: str) -> list[parse.TaskEnd]:
    return parse.srun_task_ends((OUT / f"srun_kill_on_bad_exit_{name}.stderr.txt").read_text())


@pytest.mark.parametrize("name, task, how, sig", [
    ("sigkill", 1, "Killed", "SIGKILL"),
    ("segv", 0, "Segmentation fault", "SIGSEGV"),
    ("exit3", 0, "Exited with exit code 3", None),
])
def test_the_task_that_ended_the_step_is_the_first_srun_reported(name, task, how, sig):
    """With --kill-on-bad-exit srun reports the culprit, terminates the step, then reports its peers."""
    found = ends(name)
    assert [(e.node, e.after_step_signal) for e in found] == [("n1", False), ("n1", True)]
    assert found[1].how == "Terminated" and found[1].signal == "SIGTERM" and found[1].task == 1 - task
    death = first_death(found)
    assert (death.node, death.task, death.how, death.signal) == ("n1", task, how, sig)


def test_ranges_core_dumps_and_other_lines():
    text = ("train: step 3\nsrun: error: n2: tasks 0-2: Killed\n"
            "srun: error: n1: task 5: Segmentation fault (core dumped)\nsrun: error: n3: task 1: Out Of Memory\n")
    found = parse.srun_task_ends(text)
    assert [(e.node, e.task, e.signal) for e in found] == [("n2", 0, "SIGKILL"), ("n2", 1, "SIGKILL"),
                                                           ("n2", 2, "SIGKILL"), ("n1", 5, "SIGSEGV"),
                                                           ("n3", 1, "OOM")]
    assert parse.srun_task_ends("") == [] and first_death([]) is None


def verdict(**over):
    kw = dict(exit_code=143, ends=ends("sigkill"), stopping=False, job_state="RUNNING", hang=False, lost=[],
              restarts=0, max_restarts=2)
    kw.update(over)
    return decide(**kw)


def test_a_rank_killed_by_a_signal_is_restarted_within_the_budget_then_requeued():
    v = verdict()
    assert v.action == "restart" and v.death.task == 1 and "restart 1 of 2" in v.reason
    assert verdict(restarts=1).action == "restart"
    spent = verdict(restarts=2)
    assert spent.action == "requeue" and "train.max_restarts = 2" in spent.reason
    assert verdict(max_restarts=0).action == "requeue"
    assert verdict(ends=ends("segv")).action == "restart"


def test_a_lost_node_requeues_at_once():
    v = verdict(lost=[{"node": "n1", "state": "DOWN", "reason": "x", "restart_count": 0}])
    assert v.action == "requeue" and "n1 (DOWN)" in v.reason


@pytest.mark.parametrize("over, why", [
    ({"exit_code": 0}, "ended 0"),                           # done or drained
    ({"ends": ends("exit3")}, "exit code decides"),          # an exception's exit, NO_PROGRESS: a human looks
    ({"stopping": True}, "SLURM is ending"),                 # requeue, preemption, cancel: SIGTERM to us
    ({"job_state": "COMPLETING"}, "SLURM is ending"),
    ({"hang": True}, "hang"),                                # the node agent killed wedged ranks
    ({"ends": [parse.TaskEnd("n1", 0, "Terminated", "SIGTERM", False)]}, "exit code decides"),
    ({"ends": []}, "srun exit code 143"),
])
def test_what_is_left_to_the_jobs_own_contract(over, why):
    v = verdict(**over)
    assert v.action == "leave" and why in v.reason, v.reason


def test_the_rendered_script_runs_the_trainer_step_under_the_supervisor():
    """The batch shell execs the supervisor, which runs submitit's srun with --kill-on-bad-exit=1."""
    from rlslurm.slurm.hetjob import Component, ScriptRenderer, submission_script

    ex = ScriptRenderer("/runs/x/logs/submitit", components=[Component(partition="rollout")], python="/venv/python")
    ex.update_parameters(partition="train", nodes=1, ntasks_per_node=2, time=5)
    lines = submission_script(ex).splitlines()
    assert lines[-2] == "exec /venv/python -u -m rlslurm.slurm.supervisor -- \\"
    assert lines[-1].startswith("srun ") and "--het-group=0 --kill-on-bad-exit=1 /venv/python" in lines[-1]


def test_keep_off_records_the_node_and_slurms_refusal(tmp_path, monkeypatch):
    """excluded_nodes.json holds the node even where SLURM refuses ExcNodeList (a running job: measured)."""
    import json

    from rlslurm.errors import SlurmCommandError
    from rlslurm.rundir import RunDir
    from rlslurm.slurm import commands, rejoin

    def refuse(*args, **kw):
        err = SlurmCommandError("`scontrol update` exited 1")
        err.stderr = "Job is no longer pending execution for job 7\n"
        raise err
    monkeypatch.setattr(commands, "scontrol", refuse)
    run = RunDir(tmp_path)
    node = {"node": "n1", "state": "trainer rank 0 died (Killed)", "reason": "budget spent", "restart_count": 0}
    assert rejoin.keep_off(run, ["7"], [node]) == ["n1"]
    (kept,) = json.loads((tmp_path / rejoin.EXCLUDED).read_text())
    assert kept["node"] == "n1" and kept["refused"] == "Job is no longer pending execution for job 7"
    assert rejoin.keep_off(run, ["7"], []) == []


def test_diag_names_a_finished_run_with_a_rank_restarted_in_the_allocation_finished():
    """A real run (tests/data/trainer_restart/finished: recorded by tests/data/diag/record.py from the cluster
    test's run): trainer rank 0 SIGKILLed, srun's `task 0: Killed` and rank 1's gloo traceback in the logs, the
    ranks restarted in the allocation, the job finished. diag calls it finished, the crash its evidence."""
    from dataclasses import replace

    from test_diag_recorded import recorded_facts

    from rlslurm import events
    from rlslurm.diag.summary import classify, render

    facts = recorded_facts(Path(__file__).resolve().parents[1] / "data" / "trainer_restart" / "finished")
    causes = classify(facts)
    assert causes[0].kind == "finished", render(causes)
    assert "trainer rank crash: rank 0 on n1 died (Killed), restarted in the allocation (restart 1 of 2)" in \
        causes[0].evidence
    # Without the supervisor's word the same srun line is a crash, not evidence.
    unexplained = replace(facts, events=[e for e in facts.events if not events.TRAINER_RESTARTED.matches(e)])
    assert classify(unexplained)[0].kind == "rank_crash"


def test_without_a_run_directory_the_step_runs_once_with_its_exit_code(monkeypatch):
    """HetSlurmExecutor runs any function: the supervisor then only runs the step (here a real process)."""
    from rlslurm.rundir import ENV_VAR
    from rlslurm.slurm.supervisor import main

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert main(["--", "sh", "-c", "exit 3"]) == 3
    assert main(["--", "true"]) == 0

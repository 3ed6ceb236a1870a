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


@pytest.mark.parametrize("name, running, ends_how", [
    ("srun_wait_expired", (1,), {1: "Killed"}),
    ("srun_wait_expired_4tasks", (1, 2, 3), {1: "Killed", 2: "Exited with exit code 137", 3: "Killed"}),
])
def test_srun_wait_names_the_ranks_that_outlived_rank_0s_clean_exit(name, running, ends_how):
    """`srun --wait=3` of tasks that outlive task 0's exit 0 (real captures): who exited, who srun then ended."""
    text = (OUT / f"{name}.stderr.txt").read_text()
    wait = parse.srun_wait_expired(text)
    assert wait == parse.WaitExpired(after_s=3, exited=(0,), running=running)
    assert {e.task: e.how for e in parse.srun_task_ends(text)} == ends_how


def test_no_wait_report_without_srun_saying_so():
    for name in ("sigkill", "segv", "exit3"):
        assert parse.srun_wait_expired((OUT / f"srun_kill_on_bad_exit_{name}.stderr.txt").read_text()) is None
    assert parse.srun_wait_expired("srun: StepId=3.0 task 1: running\n") is None  # no `First task exited` line


def test_the_trainer_step_gets_srun_wait_of_the_exit_grace():
    from rlslurm.slurm.supervisor import with_exit_wait

    assert with_exit_wait(["srun", "--unbuffered", "python", "-m", "x"], 120.0)[:2] == ["srun", "--wait=120"]
    assert with_exit_wait(["/usr/bin/srun", "--wait=9", "python"], 120.0) == ["/usr/bin/srun", "--wait=9", "python"]
    assert with_exit_wait(["python", "-m", "x"], 120.0) == ["python", "-m", "x"]


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


OUTPUTS = Path(__file__).parent / "slurm_outputs"


def _held_job() -> list[dict]:
    """A pending 2-component het job (train -N1; rollout -N1 --exclude=n4): real `scontrol show job -o`."""
    from rlslurm.slurm import parse

    return parse.scontrol_show((OUTPUTS / "scontrol_show_job_het_held_exclude.txt").read_text())


def _partitions(name: str) -> list[str]:
    from rlslurm.slurm import parse

    (r,) = [r for r in parse.scontrol_show((OUTPUTS / "scontrol_show_partition.txt").read_text())
            if r["PartitionName"] == name]
    return parse.expand_nodelist(r["Nodes"])


def test_exclusions_keep_each_components_own_list_and_never_strand_the_job():
    """The failed node goes to the component whose partition holds it; the other keeps its own --exclude
    (SLURM's update replaces the list whole); a node whose loss leaves too few, or a pinned one, is not asked."""
    from rlslurm.slurm import rejoin

    train, rollout = rejoin.exclusions(_held_job(), ["n1"], _partitions)
    assert (train.job_id, train.exclude, train.added, train.why_not) == ("37000005", ("n1",), ("n1",), None)
    assert (rollout.job_id, rollout.exclude, rollout.added) == ("37000006", ("n4",), ())
    _, rollout = rejoin.exclusions(_held_job(), ["n3"], _partitions)  # n4 is excluded already: n3 is the last
    assert rollout.added == () and rollout.exclude == ("n4",)
    assert rollout.why_not == "partition rollout would keep 0 node(s) for the 1 that component 37000006 needs"
    pinned = [{**r, "ReqNodeList": "n[1-2]", "NumNodes": "2"} for r in _held_job()][:1]
    (train,) = rejoin.exclusions(pinned, ["n2"], _partitions)
    assert train.added == () and train.why_not == "component 37000005 asks for n2 by name (--nodelist)"


def test_keep_off_updates_the_leader_first_and_records_what_slurm_took(tmp_path, monkeypatch):
    import json

    from rlslurm.errors import SlurmCommandError
    from rlslurm.rundir import RunDir
    from rlslurm.slurm import commands, rejoin

    updates = []
    monkeypatch.setattr(commands, "scontrol", lambda *args, **kw: updates.append(args))
    run = RunDir(tmp_path)
    node = {"node": "n1", "state": "trainer rank 0 died (Killed)", "reason": "budget spent", "restart_count": 0}
    assert rejoin.keep_off(run, "37000005", [node], show_job=lambda job: _held_job(),
                           partition_nodes=_partitions) == ["n1"]
    # The leader's update is copied to every component by SLURM: the rollout component gets n4 back after it.
    assert updates == [("update", "JobId=37000005", "ExcNodeList=n1"), ("update", "JobId=37000006", "ExcNodeList=n4")]
    (kept,) = json.loads((tmp_path / rejoin.EXCLUDED).read_text())
    assert kept["node"] == "n1" and kept["excluded"] is True and "refused" not in kept

    def refuse(*args, **kw):
        err = SlurmCommandError("`scontrol update` exited 1")
        err.stderr = "Job is no longer pending execution for job 7\n"
        raise err
    monkeypatch.setattr(commands, "scontrol", refuse)
    assert rejoin.keep_off(run, "37000005", [node], show_job=lambda job: _held_job(), partition_nodes=_partitions) == []
    refused = json.loads((tmp_path / rejoin.EXCLUDED).read_text())[-1]
    assert refused["excluded"] is False and refused["refused"] == "Job is no longer pending execution for job 7"
    lost_last = {**node, "node": "n3"}
    assert rejoin.keep_off(run, "37000005", [lost_last], show_job=lambda job: _held_job(),
                           partition_nodes=_partitions) == []
    stranded = json.loads((tmp_path / rejoin.EXCLUDED).read_text())[-1]
    assert stranded["not_asked"].startswith("partition rollout would keep 0 node(s)")
    assert rejoin.keep_off(run, "7", []) == []



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
    # Without the supervisor's word the same srun line is a crash: the job still finished (issue 28: one rule for
    # a finished job), so it is what the job survived, named under "finished".
    unexplained = replace(facts, events=[e for e in facts.events if not events.TRAINER_RESTARTED.matches(e)])
    (cause,) = classify(unexplained)
    assert cause.kind == "finished", render([cause])
    assert any(line.startswith("survived rank_crash: trainer rank crash: srun says task 0 on n1: Killed")
               for line in cause.evidence), cause.evidence


def test_without_a_run_directory_the_step_runs_once_with_its_exit_code(monkeypatch):
    """HetSlurmExecutor runs any function: the supervisor then only runs the step (here a real process)."""
    from rlslurm.rundir import ENV_VAR
    from rlslurm.slurm.supervisor import main

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert main(["--", "sh", "-c", "exit 3"]) == 3
    assert main(["--", "true"]) == 0


def test_status_says_whether_slurm_kept_the_job_off_a_failed_node():
    from rlslurm.status import Status, render

    what = {"state": "trainer rank 0 died (Killed)", "reason": "budget spent", "restart_count": 0}
    lines = render(Status(run_dir="r", job_id="7", backend="slurm", excluded=[
        {**what, "node": "n1", "excluded": True},
        {**what, "node": "n2", "excluded": False, "refused": "Job is no longer pending execution"},
        {**what, "node": "n3", "excluded": False, "not_asked": "partition rollout would keep 0 node(s)"}]))
    assert "kept off node n1: lost at restart 0 (trainer rank 0 died (Killed): budget spent); SLURM excluded it" \
        in lines
    assert "not kept off node n2: lost at restart 0 (trainer rank 0 died (Killed): budget spent); SLURM refused: " \
        "Job is no longer pending execution" in lines
    assert "not kept off node n3: " in lines and "; partition rollout would keep 0 node(s)" in lines

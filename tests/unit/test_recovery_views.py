"""What a person reads about a fault the job went through (issue 38), from events and heartbeats alone: `rlslurm
status` names the rank that failed first, says which engines left the rotation and never calls a process of a
finished job running; `rlslurm diag` names a drain on SLURM's SIGTERM a preemption, every engine once one met a
fault, and the reward service's restarts and its workers' deaths; the node agent knows a job SLURM suspended.
The real runs are tests/cluster/test_recovery_slurm.py; these are the rules, on an injected clock."""

from __future__ import annotations

import signal

import psutil

from rlslurm import events
from rlslurm.diag.config import DiagConfig
from rlslurm.diag.heartbeat import HeartbeatWriter
from rlslurm.diag.stack_dump import StackDump
from rlslurm.diag.summary import Facts, classify
from rlslurm.diag.watchdog import Watchdog
from rlslurm.progress import Progress
from rlslurm.rundir import RunDir
from rlslurm.status import Status, ended_as, engines_out, render


def _ev(kind: str, t: float, **fields) -> dict:
    return {"kind": kind, "t": t, "host": "n1", "pid": 1, "role": "train", "rank": 0, **fields}


def test_status_names_the_first_failure_of_a_start_not_its_echo_on_a_peer(tmp_path):
    run = RunDir(tmp_path).create()
    for e in (_ev("start", 1.0, step=0, restart_count=0),
              _ev("phase_failed", 2.0, phase="checkpoint", step=4, traceback="...",
                  error="PermissionError: [Errno 13] Permission denied: 'checkpoints/.tmp-step-00000004-77'"),
              _ev("phase_failed", 2.5, rank=1, phase="checkpoint", step=4, traceback="...",
                  error="RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer")):
        run.append_json(run.events, e)
    line = Progress(run, total_steps=10).poll()
    assert "failed in checkpoint: PermissionError" in line and "Connection closed by peer" not in line, line


def test_status_of_a_finished_job_calls_no_process_running_and_lists_engines_out():
    evs = [_ev("start", 1.0, step=0, restart_count=0),
           _ev("engine_down", 5.0, role="rollout", engine=0, node="n3", restarts=1, max_restarts=1, reason="died",
               log="logs/engine-0.log"),
           _ev("done", 9.0, step=8, policy_version=8)]
    roles = [{"role": "rollout", "rank": 0, "host": "n3", "step": 2, "phase": "rollout", "state": "running",
              "progress_age_s": 30.0},
             {"role": "rollout", "rank": 1, "host": "n3", "step": 8, "phase": "rollout", "state": "exited",
              "progress_age_s": 1.0}]
    status = Status(run_dir=".", job_id="12", backend="slurm", roles=roles, ended=ended_as([], evs),
                    engines=engines_out(evs, roles))
    text = render(status)
    assert "ended: finished" in text
    assert "rollout-0 on n3: not running: the job ended (finished); its heartbeat stopped at step 2" in text, text
    assert ": running" not in text
    assert "engine 0 down past rollout.max_restarts = 1 (1 replacements; last: died)" in text, text
    assert "serving: engine 1 (1 of 2)" in text
    # A later submission (a resume) makes the earlier `done` history: running again, not finished.
    assert ended_as([{"component": "0", "state": "RUNNING"}], evs + [_ev("submitted", 10.0, job_id="13",
                                                                       backend="slurm", layout={})]) is None


def test_diag_names_a_drain_on_slurms_sigterm_a_preemption():
    evs = [_ev("start", 1.0, step=0, restart_count=0),
           _ev("drain_requested", 5.0, reason="signal SIGTERM", signal="SIGTERM"),
           _ev("job_sigterm", 5.0, role="supervisor", components=["12", "13"],
               relayed={"12": "signalled", "13": "signalled"}),
           _ev("drained", 5.4, step=6, reason="rank 0: signal SIGTERM", signal="SIGTERM", job_id="12",
               checkpoint="step-00000006", requeued="not by this job: SLURM sent SIGTERM ...")]
    cause = classify(Facts(events=evs, slurm_state="FAILED", host="h", now=100.0))[0]
    assert cause.kind == "preempted", cause
    # SLURM's COMPLETED of a job that drained without its `done` (an exit 0 of submitit's) is no finish either.
    assert classify(Facts(events=evs, slurm_state="COMPLETED", host="h", now=100.0))[0].kind == "preempted"
    assert "every rank drained at step 6 (checkpoint step-00000006, where it resumes)" in cause.headline
    assert "`rlslurm resume` continues it" in cause.headline
    assert any("passed SIGTERM on to components ['12', '13']" in line for line in cause.evidence)
    # Requeued and finished: the earlier attempt is said a preemption, not a "drained" among others.
    later = evs + [_ev("resume", 20.0, step=6, checkpoint="step-00000006", restart_count=1),
                   _ev("done", 30.0, step=10, policy_version=10)]
    done = classify(Facts(events=later, slurm_state="COMPLETED", host="h", now=100.0))[0]
    assert done.kind == "finished" and ("earlier attempt: preempted by SLURM (SIGTERM): drained at step 6, "
                                        "checkpoint step-00000006") in done.evidence, done


def test_diag_lists_reward_service_restarts_and_worker_deaths_of_a_finished_job():
    evs = [_ev("start", 1.0, step=0, restart_count=0),
           _ev("reward_service_died", 3.0, role="reward", pid=50, exit_code=-9),
           _ev("reward_service_restarted", 4.0, role="reward", restarts=1, pid=51, reason="died", start_s=1.2,
               url="http://127.0.0.1:1"),
           _ev("reward_worker_died", 6.0, role="reward", what="reward.function f.py:score", worker_pid=60,
               exit_code=-11),
           _ev("done", 9.0, step=8, policy_version=8)]
    cause = classify(Facts(events=evs, slurm_state="COMPLETED", host="h", now=100.0))[0]
    assert cause.kind == "finished"
    assert "reward service died (pid 50, exit code -9)" in cause.evidence
    assert any(line.startswith("reward service restarted by its supervisor (restart 1, pid 51") for line in
               cause.evidence)
    assert ("reward worker (reward.function f.py:score) pid 60 died while scoring (exit code -11): its item "
            "unscored, a fresh worker took its slot") in cause.evidence


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_the_node_agent_knows_a_job_slurm_suspended_and_counts_ages_from_its_resume(tmp_path):
    run = RunDir(tmp_path).create()
    clock = Clock()
    beat = HeartbeatWriter(run, "train", 0, interval_s=1, clock=clock, job_id="9", background=False)
    beat.update(phase="train", step=3, phase_timeout_s=60.0, force=True)
    states = {"proc": psutil.STATUS_STOPPED, "slurm": "SUSPENDED"}
    dog = Watchdog(run, DiagConfig(hang_policy="dump"), clock=clock,
                   dump=lambda pid, **kw: StackDump(pid, "Thread 1\n", "py-spy", "stopped"),
                   state=lambda pid: states["proc"], job_state=lambda: states["slurm"])
    clock.t += 600  # ten minutes suspended: every rank stopped, SLURM says so
    assert dog.poll() is None and dog.poll() is None
    (said,) = events.read_events(run, events.JOB_SUSPENDED)
    assert said["ranks"] == ["train-0"] and said["slurm_state"] == "SUSPENDED"
    states.update(proc=psutil.STATUS_SLEEPING, slurm="RUNNING")  # `scontrol resume`
    assert dog.poll() is None  # the resume seen: ages count from here
    clock.t += 59
    assert dog.poll() is None
    clock.t += 2  # past the timeout since the resume, no beat: a hang after all
    assert dog.poll() is not None


def test_a_stopped_rank_slurm_does_not_call_suspended_is_still_a_hang(tmp_path):
    run = RunDir(tmp_path).create()
    clock = Clock()
    HeartbeatWriter(run, "train", 1, interval_s=1, clock=clock, background=False).update(
        phase="train", step=3, phase_timeout_s=60.0, force=True)
    dog = Watchdog(run, DiagConfig(hang_policy="dump"), clock=clock,
                   dump=lambda pid, **kw: StackDump(pid, "Thread 1\n", "py-spy", "stopped"),
                   state=lambda pid: psutil.STATUS_STOPPED, job_state=lambda: "RUNNING")  # a SIGSTOP, not SLURM
    clock.t += 61
    assert dog.poll() is not None and not events.read_events(run, events.JOB_SUSPENDED)
    assert signal.SIGSTOP  # (the fault the agent names: tests/cluster/test_opskit.py makes it for real)


def test_the_node_agent_stopped_with_the_job_judges_nobody_on_the_time_it_did_not_see(tmp_path):
    """The agent is stopped by a suspend too (measured: a moment after the ranks); on the resume, its wait had
    taken ten minutes: the ranks' ten minutes without a beat are no hang. A real silence after it still is."""
    run = RunDir(tmp_path).create()
    clock = Clock()
    beat = HeartbeatWriter(run, "train", 0, interval_s=1, clock=clock, job_id="9", background=False)
    beat.update(phase="train", step=3, phase_timeout_s=60.0, force=True)
    waits = []

    def sleep(seconds):  # the agent's loop: its third wait is a suspension of 600 s
        waits.append(seconds)
        clock.t += seconds + (600 if len(waits) == 3 else 0)
        if len(waits) == 3 + 70:  # 70 s of watching after the resume, with no beat: a hang by then
            dog.stop()

    dog = Watchdog(run, DiagConfig(hang_policy="dump", watch_interval_s=1.0), clock=clock, sleep=sleep,
                   dump=lambda pid, **kw: StackDump(pid, "Thread 1\n", "py-spy", "sleeping"),
                   job_state=lambda: "RUNNING")
    dog.watch(exit_when_idle=False)
    (said,) = events.read_events(run, events.JOB_SUSPENDED)
    assert said["unobserved_s"] == 600.0 and said["ranks"] == ["train-0"]
    (hang,) = events.read_events(run, events.HANG_DETECTED)  # 61 s after the resume, not at it (age 603 s)
    assert 60 < hang["ranks"][0]["age_s"] < 70, hang["ranks"]

"""The watchdog's judgement with an injected clock: half an hour of silence passes in milliseconds."""

from __future__ import annotations

import signal

import pytest

from rlslurm.diag.config import DiagConfig
from rlslurm.diag.heartbeat import HeartbeatWriter
from rlslurm.diag.stack_dump import StackDump
from rlslurm.diag.watchdog import Watchdog, main
from rlslurm.events import read_events
from rlslurm.rundir import RunDir


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def fake_dump(pid, **kw):  # this process is the "rank": it must not be ptraced or signalled here
    return StackDump(pid, "Thread 1 (idle)\n    all_reduce (torch/distributed/distributed_c10d.py:1)\n",
                     "py-spy", "sleeping")


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path).create()


def test_no_hang_before_the_phase_timeout_then_one_report(run):
    clock = Clock()
    w = HeartbeatWriter(run, "train", 0, interval_s=1, clock=clock, job_id="9", background=False)
    w.update(phase="checkpoint", step=3, phase_timeout_s=1800.0, force=True)
    dog = Watchdog(run, DiagConfig(hang_policy="dump"), clock=clock, dump=fake_dump)
    clock.t += 1799
    assert dog.poll() is None
    clock.t += 2
    report = dog.poll()
    assert report is not None and report.waiting == ["train-0"] and report.collective == "all_reduce"
    assert dog.poll() is None  # the same hang is reported once
    (event,) = read_events(run, "hang_detected")
    assert event["ranks"][0]["age_s"] == pytest.approx(1801) and event["ranks"][0]["timeout_s"] == 1800
    assert (report.stacks_dir / f"{event['ranks'][0]['host']}-train-0.txt").read_text().startswith("# train-0")
    w.update(phase="checkpoint", force=True)  # progress again, then a new silence: a new report
    clock.t += 1801
    assert dog.poll() is not None


def test_requeue_policy_drains_requeues_and_kills_with_sigkill_after_grace(run):
    clock = Clock()
    w = HeartbeatWriter(run, "rollout", 2, interval_s=1, clock=clock, job_id="31", background=False)
    w.update(phase="rollout", phase_timeout_s=60.0, force=True)
    requeued, signals = [], []
    dog = Watchdog(run, DiagConfig(hang_policy="requeue", kill_grace_s=30), clock=clock, sleep=clock.sleep,
                   dump=fake_dump, requeue=requeued.append, kill=lambda pid, sig: signals.append(sig))
    clock.t += 61
    dog.poll()
    assert requeued == ["31"] and (run.control / "drain").is_file()
    # the recorder does not really kill, so the grace ran out (on the injected clock) and SIGKILL followed
    assert signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    (action,) = read_events(run, "hang_action")
    assert action["killed"] == {"rollout-2": f"pid {w.record['pid']}: SIGTERM, SIGKILL"}


def test_heartbeats_of_other_hosts_and_dead_pids_are_not_watched(run):
    clock = Clock()
    HeartbeatWriter(run, "train", 0, interval_s=1, clock=clock, host="othernode", background=False).update(force=True)
    dead = HeartbeatWriter(run, "train", 1, interval_s=1, clock=clock, background=False)
    dead.record["pid"] = 2**22 + 7  # above any pid_max default: no such process
    dead.update(force=True)
    clock.t += 10_000
    assert Watchdog(run, DiagConfig(), clock=clock).watched() == []


def test_agent_once_on_a_quiet_run_exits_0(run):
    assert main(["--run-dir", str(run.path), "--once"]) == 0

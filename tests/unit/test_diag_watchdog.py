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


def test_a_rank_in_a_collective_counts_as_waiting_before_its_own_timeout_and_is_killed_too(run):
    clock = Clock()
    stuck = HeartbeatWriter(run, "train", 1, interval_s=1, clock=clock, background=False)
    stuck.update(phase="data", step=10, phase_timeout_s=5.0, force=True)
    clock.t += 0.2  # the peer entered its all_reduce a moment after the stuck rank's last beat
    waiter = HeartbeatWriter(run, "train", 0, interval_s=1, clock=clock, background=False)
    waiter.update(phase="train", step=10, phase_timeout_s=5.0, force=True)

    def dump(pid, faulthandler_file, **kw):
        # Both heartbeats name this process: tell the ranks apart by the faulthandler file the dog passes.
        if faulthandler_file.name.endswith("-0.txt"):
            return fake_dump(pid)
        return StackDump(pid, "Thread 2 (idle)\n    load (data.py:7)\n", "py-spy", "sleeping")

    signals = []
    dog = Watchdog(run, DiagConfig(hang_policy="fail", kill_grace_s=0), clock=clock, sleep=clock.sleep,
                   dump=dump, kill=lambda pid, sig: signals.append(sig))
    clock.t += 5.1
    waiter.update(phase="train", step=10, force=True)  # train-0 beat just now; train-1 is 5.3 s silent
    report = dog.poll()
    assert [r.name for r in report.hung] == ["train-1"]
    assert report.waiting == ["train-0"] and report.elsewhere == ["train-1"] and report.collective == "all_reduce"
    assert "1 rank in all_reduce of train step 10 (train-0), train-1 in the data phase step 10 at load " \
           "(data.py:7)" in report.message and "train-0 0.0 s of 5 s" in report.message
    (action,) = read_events(run, "hang_action")
    assert sorted(action["killed"]) == ["train-0", "train-1"]  # the waiting rank is wedged as well


def test_a_stopped_rank_caught_inside_the_collective_is_the_stuck_one_not_a_waiter(run):
    """SIGSTOP can land while a rank sits in all_reduce: its stack then shows the collective too, but a
    process in state T waits on nobody, so it is named stuck and its peer is the one waiting."""
    clock = Clock()
    stopped = HeartbeatWriter(run, "train", 1, interval_s=1, clock=clock, background=False)
    stopped.update(phase="train", step=4, phase_timeout_s=3.0, force=True)
    peer = HeartbeatWriter(run, "train", 0, interval_s=1, clock=clock, background=False)
    peer.update(phase="train", step=4, phase_timeout_s=3.0, force=True)

    def dump(pid, faulthandler_file, **kw):
        state = "sleeping" if faulthandler_file.name.endswith("-0.txt") else "stopped"
        return StackDump(pid, fake_dump(pid).text, "py-spy", state)

    dog = Watchdog(run, DiagConfig(hang_policy="dump"), clock=clock, dump=dump)
    clock.t += 3.5
    report = dog.poll()
    assert report.elsewhere == ["train-1"] and report.waiting == ["train-0"] and report.collective == "all_reduce"
    assert "process stopped (state T)" in report.message and report.message.endswith("train-0 waits on train-1")


def test_agent_exits_when_no_heartbeat_appears_within_the_idle_limit(run):
    clock = Clock()
    dog = Watchdog(run, DiagConfig(agent_idle_exit_s=30, watch_interval_s=1), clock=clock, sleep=clock.sleep)
    assert dog.watch() == 0
    assert 30 <= clock.t - 1_000_000.0 <= 32


def test_agent_exits_when_its_parent_is_gone(run, tmp_path):
    """A real orphan: the agent's parent is SIGKILLed (as a hung rank 0 is at KillWait); the agent must go."""
    import subprocess
    import sys
    import time

    import psutil

    log = tmp_path / "agent.log"
    script = ("import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-m', 'rlslurm.diag.watchdog', '--run-dir', {str(run.path)!r},"
              f" '--watch-interval-s', '0.1'], start_new_session=True, stderr=open({str(log)!r}, 'w'))\n"
              "print(p.pid, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    agent = psutil.Process(int(parent.stdout.readline()))
    assert agent.is_running()
    time.sleep(0.5)
    assert agent.status() != psutil.STATUS_ZOMBIE  # no heartbeat yet, idle limit 600 s: still watching
    parent.kill()
    parent.wait(5)
    started = time.monotonic()
    agent.wait(10)  # not our child: psutil cannot tell its exit code, the log says why it left
    assert time.monotonic() - started < 5
    assert f"exiting: parent pid {parent.pid} is gone" in log.read_text()


def test_parent_pid_reuse_is_not_mistaken_for_the_parent(run):
    import os

    dog = Watchdog(run, DiagConfig(), parent_pid=os.getpid())
    assert not dog.parent_gone()
    dog._parent_started -= 10  # as if this pid now belonged to a later process
    assert dog.parent_gone()
    assert not Watchdog(run, DiagConfig(), parent_pid=None).parent_gone()

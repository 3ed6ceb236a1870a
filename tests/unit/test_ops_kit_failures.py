"""The ops kit's own failures (issue 19, part 4): a heartbeat that cannot be written and a node agent that dies
are events with their cause, shown by `rlslurm status` and named by diag, never a false hang.

The unwritable heartbeat is a real OSError from the write: a full filesystem (a tmpfs of 64 KiB mounted over
the heartbeat directory, filled) where this user may mount, a directory without write permission otherwise.
The dying agent is the real `python -m rlslurm.diag.watchdog`, SIGKILLed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_diag_watchdog import Clock, fake_dump

from rlslurm import events
from rlslurm.diag.agent import AgentKeeper
from rlslurm.diag.config import DiagConfig
from rlslurm.diag.heartbeat import HeartbeatWriter, read_heartbeat
from rlslurm.diag.summary import Facts, classify
from rlslurm.diag.watchdog import Watchdog
from rlslurm.rundir import RunDir
from rlslurm.status import ops_problems
from waiting import wait_for


@contextlib.contextmanager
def unwritable_dir(path: Path):
    """Yield (make_unwritable, make_writable) for `path`: a full tmpfs as root, chmod 0500 otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=True)
        filler = path / ".filler"

        def block():
            with contextlib.suppress(OSError), open(filler, "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()

        try:
            yield block, lambda: filler.unlink()
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
    else:
        try:
            yield lambda: path.chmod(0o500), lambda: path.chmod(0o755)
        finally:
            path.chmod(0o755)


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path / "run").create()


def test_a_heartbeat_that_cannot_be_written_is_an_event_and_the_flusher_lives_on(run):
    with unwritable_dir(run.heartbeats) as (block, unblock):
        w = HeartbeatWriter(run, "train", 0, interval_s=0.05, job_id="7")
        w.update(phase="train", step=1, phase_timeout_s=5.0, force=True)
        block()
        w.update(phase="train", step=2)
        (event,) = wait_for("the heartbeat_unwritable event",
                            lambda: events.read_events(run, events.HEARTBEAT_UNWRITABLE), timeout_s=10)
        expected = errno.ENOSPC if os.geteuid() == 0 else errno.EACCES
        assert event["errno"] == expected and event["path"] == str(w.path), event
        assert os.strerror(expected) in event["error"] and (event["role"], event["rank"]) == ("train", 0)
        time.sleep(0.3)  # several intervals of failing writes: still one event, the thread still alive
        assert len(events.read_events(run, events.HEARTBEAT_UNWRITABLE)) == 1 and w._thread.is_alive()
        assert read_heartbeat(w.path)["step"] == 1
        assert ops_problems(events.read_events(run))[0].startswith(f"heartbeat of train-0 (pid {os.getpid()} on ")
        unblock()
        wait_for("the heartbeat written again", lambda: (read_heartbeat(w.path) or {}).get("step") == 2, timeout_s=10)
        (restored,) = events.read_events(run, events.HEARTBEAT_RESTORED)
        assert restored["unwritable_s"] > 0.2
        assert ops_problems(events.read_events(run)) == []  # written again: no longer a problem
        w.close()


def test_the_watchdog_does_not_call_an_unwritable_heartbeat_a_hang_and_judges_it_again_once_written(run):
    clock = Clock(time.time())
    with unwritable_dir(run.heartbeats) as (block, unblock):
        stuck = HeartbeatWriter(run, "train", 1, interval_s=1, clock=clock, background=False)
        stuck.update(phase="train", step=3, phase_timeout_s=60.0, force=True)
        blocked = HeartbeatWriter(run, "train", 0, interval_s=1, clock=clock, background=False)
        blocked.update(phase="train", step=3, phase_timeout_s=60.0, force=True)
        block()
        blocked.update(step=4, force=True)  # the write fails: an event, no exception
        dog = Watchdog(run, DiagConfig(hang_policy="dump"), clock=clock, dump=fake_dump)
        clock.t += 61
        report = dog.poll()
        # train-1 (whose heartbeat was written) is the hang; train-0's age is its disk's, not its own
        assert report is not None and {r.name for r in report.hung} == {"train-1"}, report.message
        assert [r.unwritable for r in report.watched if r.name == "train-0"][0].startswith("OSError")
        unblock()
        blocked.update(progress=False, force=True)  # written again, no progress since clock.t - 61
        clock.t += 1
        again = dog.poll()
        assert again is not None and "train-0" in {r.name for r in again.hung}


def test_diag_names_the_unwritable_heartbeat_and_a_dead_agent(run):
    with unwritable_dir(run.heartbeats) as (block, _):
        w = HeartbeatWriter(run, "train", 0, interval_s=1, background=False)
        events.emit(run, events.START, step=0, restart_count=0)
        block()
        w.update(step=1, force=True)
    facts = Facts(events=events.read_events(run), heartbeats=[w.record], pid_alive=lambda hb: True)
    first = classify(facts)[0]
    assert first.kind == "heartbeat_unwritable" and first.headline.startswith("heartbeat cannot be written: train-0")
    assert os.strerror(errno.ENOSPC if os.geteuid() == 0 else errno.EACCES) in first.headline


AGENT = [sys.executable, "-m", "rlslurm.diag.watchdog", "--parent-pid", "0"]


def agent_starter(run: RunDir, log_path: Path):
    """What the job's keeper is given: start the real node agent of `run`, its output into `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def start():
        with open(log_path, "ab") as out:
            return subprocess.Popen([*AGENT, "--run-dir", str(run.path)], stdout=out, stderr=subprocess.STDOUT)

    return start


def test_a_killed_node_agent_is_an_event_with_its_cause_and_is_restarted_within_its_budget(run):
    log_path = run.logs / "watchdog-train-n1.log"
    keeper = AgentKeeper(run, agent_starter(run, log_path), log_path=log_path, node="n1", max_restarts=1)
    first = keeper.proc
    try:
        wait_for("the agent's first log line", lambda: "watching heartbeats" in log_path.read_text(), timeout_s=30)
        first.send_signal(signal.SIGKILL)
        (died,) = wait_for("node_agent_died", lambda: events.read_events(run, events.NODE_AGENT_DIED), timeout_s=10)
        assert (died["agent_pid"], died["returncode"], died["signal"]) == (first.pid, -9, "SIGKILL")
        assert died["cause"] == "killed by SIGKILL" and died["restarted"] is True and died["node"] == "n1"
        assert "watching heartbeats" in died["log_tail"] and died["log"] == str(log_path)
        wait_for("a new agent", lambda: keeper.proc is not first and keeper.proc.poll() is None, timeout_s=10)
        keeper.proc.send_signal(signal.SIGKILL)  # past the budget of 1: said, not restarted
        wait_for("the second death", lambda: len(events.read_events(run, events.NODE_AGENT_DIED)) == 2, timeout_s=10)
        last = events.read_events(run, events.NODE_AGENT_DIED)[-1]
        assert last["restarted"] is False
        lines = ops_problems(events.read_events(run))
        assert lines[0].startswith(f"node agent pid {first.pid} on n1 killed by SIGKILL at ")
        assert "; restarted" in lines[0]
        assert "not restarted: hangs on this node go unwatched" in lines[1]
        cause = classify(Facts(events=events.read_events(run)))[0]
        assert cause.kind == "agent_died" and cause.headline.startswith(f"node agent died: pid {first.pid} on n1 "
                                                                        "killed by SIGKILL; restarted")
    finally:
        keeper.stop()


def test_an_agent_stopped_by_the_job_is_no_death(run):
    log_path = run.logs / "watchdog.log"
    keeper = AgentKeeper(run, agent_starter(run, log_path), log_path=log_path, node="n1")
    wait_for("the agent's first log line", lambda: "watching heartbeats" in log_path.read_text(), timeout_s=30)
    keeper.stop()
    assert keeper.proc.wait(timeout=10) == 0 and not keeper._thread.join(timeout=5)
    assert events.read_events(run, events.NODE_AGENT_DIED) == []

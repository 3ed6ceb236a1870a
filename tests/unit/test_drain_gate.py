"""The drain gate: code requests, the control file (rate-limited), real signals, the KillWait deadline."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlslurm.diag.drain_gate import DrainGate
from rlslurm.events import read_events
from rlslurm.rundir import RunDir


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir(tmp_path / "run").create()


def _deliver(gate: DrainGate, signum: int) -> None:
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 5.0
    while gate.signal_name != signal.Signals(signum).name:  # Python runs the handler at the next bytecode
        if time.monotonic() > deadline:
            raise AssertionError(f"{signal.Signals(signum).name} never reached the gate")
        time.sleep(0.001)


def test_request_is_sticky_and_the_first_reason_wins(run):
    clock = Clock()
    gate = DrainGate(run, clock=clock)
    assert not gate.requested and not gate.check() and gate.reason is None
    gate.request("operator asked")
    clock.now = 101.0
    gate.request("second")
    assert gate.check() and gate.check()
    assert (gate.reason, gate.requested_at) == ("operator asked", 100.0)
    (event,) = read_events(run, "drain_requested")  # one event however often check() runs
    assert event["reason"] == "operator asked" and event["signal"] is None


def test_control_file_is_noticed_at_most_every_poll_interval(run):
    clock = Clock()
    gate = DrainGate(run, clock=clock, poll_interval_s=1.0)
    assert not gate.check()
    (run.control / "drain").touch()
    clock.now = 100.5
    assert not gate.check()  # still inside the poll interval: no stat
    clock.now = 101.0
    assert gate.check() and gate.reason.startswith("control file ")
    assert gate.consume_control_file() and not (run.control / "drain").exists()
    assert not gate.consume_control_file()


def test_without_a_run_directory_only_requests_and_signals_count():
    gate = DrainGate(None)
    assert not gate.check()
    gate.request("x")
    assert gate.check() and not gate.consume_control_file()


def test_sigusr1_sets_the_flag_without_io_and_handlers_are_restored(run):
    gate = DrainGate(run)
    before = signal.getsignal(signal.SIGTERM)
    gate.install_signal_handlers()
    try:
        _deliver(gate, signal.SIGUSR1)
        assert gate.requested and gate.reason == "signal SIGUSR1" and gate.kill_wait_left_s() is None
        assert not run.events.exists()  # the handler wrote nothing; check() reports it
        assert gate.check() and read_events(run, "drain_requested")[0]["signal"] == "SIGUSR1"
    finally:
        gate.restore_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_starts_the_kill_wait_clock_even_after_usr1(run):
    clock = Clock()
    gate = DrainGate(run, clock=clock, kill_wait_s=30.0)
    gate.install_signal_handlers()
    try:
        _deliver(gate, signal.SIGUSR1)
        clock.now = 110.0
        _deliver(gate, signal.SIGTERM)
        clock.now = 122.5
        assert gate.reason == "signal SIGUSR1" and gate.signal_name == "SIGTERM"
        assert gate.kill_wait_left_s() == pytest.approx(17.5)
    finally:
        gate.restore_signal_handlers()


def test_a_control_file_older_than_this_process_is_a_stale_request_and_ignored(run):
    """The node agent writes control/drain on a hang, then requeues; the next start must not drain at once."""
    path = run.control / "drain"
    path.write_text("hang detected\n")
    os.utime(path, (1000.0, 1000.0))
    gate = DrainGate(run, clock=Clock(), not_before=2000.0)
    assert not gate.check() and not gate.check()
    (stale,) = read_events(run, "drain_request_stale")  # said once, not at every poll
    assert "1001.0 s before this process started" in stale["reason"]
    assert path.exists()  # left alone: a rank started earlier may still be the one it was meant for
    os.utime(path, (2000.5, 2000.5))  # a new request, e.g. `rlslurm drain` against this start
    gate._next_poll = 0
    assert gate.check() and gate.reason == f"control file {path}"


def test_by_default_the_process_start_time_decides(run):
    import psutil

    assert DrainGate(run).not_before == pytest.approx(psutil.Process().create_time() - 1.0)

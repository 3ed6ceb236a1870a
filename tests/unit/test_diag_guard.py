"""Phase guard and heartbeats: coalesced writes, phase timeouts, drain checks, failures recorded."""

from __future__ import annotations

import json
import time

import pytest

from rlslurm.diag.config import DiagConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.diag.heartbeat import HeartbeatWriter, read_heartbeats, table
from rlslurm.events import read_events
from rlslurm.rundir import RunDir


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


class Gate:
    """Any object with check() and requested works as the drain gate."""

    def __init__(self, after=None):
        self.checks, self.after, self.requested = 0, after, False

    def check(self):
        self.checks += 1
        self.requested = self.after is not None and self.checks >= self.after
        return self.requested

    def request(self, reason):
        self.requested = True


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path).create()


def test_beats_are_coalesced_to_one_write_per_interval(run):
    clock = Clock()
    w = HeartbeatWriter(run, "train", 0, interval_s=1.0, clock=clock, background=False)
    assert w.update() is True  # first write
    writes = 0
    for i in range(100):
        clock.t += 0.0625  # 100 beats over 6.25 s (a step exact in binary)
        writes += w.update(step=i)
    assert writes == 6
    hb = json.loads(w.path.read_text())
    # The file lags the memory by less than one interval: last written at t = 1006.0, beat 96 (step 95).
    assert (hb["written"], hb["step"], hb["beats"]) == (1006.0, 95, 97)
    assert w.record["step"] == 99 and clock.t - hb["last_progress"] < 1.0
    assert not list(run.heartbeats.glob(".*tmp"))  # the temp file was renamed into place


def test_phase_writes_its_timeout_at_once_and_checks_the_gate(run):
    clock, gate = Clock(), Gate()
    cfg = DiagConfig(heartbeat_interval_s=60, hang_timeout_s=300, phase_timeouts_s={"rollout": 900})
    guard = PhaseGuard(run, "rollout", 3, cfg, gate, clock=clock, job_id="77", background=False)
    with guard.phase("rollout", step=5):
        guard.heartbeat.flush()
        hb = read_heartbeats(run)[0]
        assert (hb["phase"], hb["step"], hb["phase_timeout_s"], hb["job_id"]) == ("rollout", 5, 900, "77")
        guard.beat()
    with guard.phase("reward", step=5):
        guard.heartbeat.flush()
        assert read_heartbeats(run)[0]["phase_timeout_s"] == 300
    assert gate.checks == 4  # both ends of both phases
    guard.close()
    hb = read_heartbeats(run)[0]
    assert hb["state"] == "exited" and "rollout-3" in table([hb])


def test_flusher_thread_writes_a_phase_change_within_the_interval_but_never_makes_progress(run):
    guard = PhaseGuard(run, "train", 0, DiagConfig(heartbeat_interval_s=0.05))
    with guard.phase("data", step=2):
        deadline = time.monotonic() + 5
        while read_heartbeats(run)[0]["phase"] != "data" and time.monotonic() < deadline:
            time.sleep(0.01)
        first = read_heartbeats(run)[0]
        assert first["phase"] == "data" and first["step"] == 2
        time.sleep(0.3)  # the thread keeps running, yet progress stays where the work left it
        assert read_heartbeats(run)[0]["last_progress"] == first["last_progress"]
    guard.close()
    assert read_heartbeats(run)[0]["state"] == "exited" and not guard.heartbeat._thread.is_alive()


def test_counted_beats_are_dated_no_later_than_made_and_a_silent_rank_ages(run):
    guard = PhaseGuard(run, "train", 0, DiagConfig(heartbeat_interval_s=0.2))  # the flusher reads every 0.05 s
    with guard.phase("train", step=4):
        guard.heartbeat.flush()
        entered = read_heartbeats(run)[0]
        time.sleep(1.0)  # the flusher reads the counter meanwhile: the beats below come after some read
        made = time.time()
        for _ in range(3):
            guard.beat()
        deadline = time.monotonic() + 5
        while read_heartbeats(run)[0]["beats"] < entered["beats"] + 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        beaten = read_heartbeats(run)[0]
        assert beaten["beats"] == entered["beats"] + 3
        # Dated at the flusher's read before them: after the phase began, never after they were made.
        assert entered["last_progress"] < beaten["last_progress"] <= made
        time.sleep(0.5)  # no beat: the heartbeat ages, the flusher reads on without making progress up
        assert read_heartbeats(run)[0]["last_progress"] == beaten["last_progress"]
    guard.close()
    final = read_heartbeats(run)[0]
    assert final["state"] == "exited" and final["beats"] == beaten["beats"] + 1  # the phase's end


def test_drain_requested_reflects_the_gate(run):
    guard = PhaseGuard(run, "train", 0, DiagConfig(), Gate(after=2), clock=Clock())
    with guard.phase("train", step=0):
        assert not guard.drain_requested
    assert guard.drain_requested
    guard.close()


def test_exception_in_a_phase_is_recorded_with_traceback_and_reraised(run):
    guard = PhaseGuard(run, "train", 1, DiagConfig(), clock=Clock())
    with pytest.raises(ZeroDivisionError):
        with guard:
            with guard.phase("step", step=7):
                with guard.phase("train", step=7):
                    _ = 1 / 0
    (event,) = read_events(run, "phase_failed")  # once, at the innermost phase
    assert event["phase"] == "train" and event["step"] == 7 and event["rank"] == 1
    assert "ZeroDivisionError" in event["traceback"] and "Traceback" in event["traceback"]
    assert read_heartbeats(run)[0]["state"] == "failed"


def test_config_rejects_bad_values():
    from rlslurm.configfile import load_mapping
    from rlslurm.errors import ConfigError

    with pytest.raises(ConfigError, match="diag.kill_grace_s = -1.0 must be >= 0"):
        load_mapping(DiagConfig, {"kill_grace_s": -1}, "job.yaml", key="diag")
    assert DiagConfig(phase_timeouts_s={"sync": 5}).timeout_for("sync") == 5
    assert DiagConfig(hang_timeout_s=9).timeout_for(None) == 9

"""The ops kit's own failures in real runs (issue 19, part 4): the toy job (2 gloo ranks, its real node agent)
through `rlslurm submit --backend local`, faulted mid-run as a user's job would meet it:

- its heartbeat directory turns read-only (a read-only bind mount over it as root, chmod 0500 otherwise):
  before, the heartbeat threads died on stderr, the node agent called a hang and killed the ranks; now each
  rank says `heartbeat_unwritable` (EROFS / EACCES), the agent does not judge it by heartbeat age, the job
  trains every step, and status and diag name the unwritable heartbeat;
- its node agent is SIGKILLed: `node_agent_died` (SIGKILL, restarted), a new agent watches, the job finishes.

    python -m pytest -q tests/integration/test_ops_kit_runs.py     # ~40 s per run on 2 idle cores
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml
from click.testing import CliRunner

from failures import node_agent, read_only
from rlslurm import events, launch
from rlslurm.cli.main import cli
from rlslurm.config import load_config
from rlslurm.rundir import RunDir
from waiting import wait_for

pytestmark = pytest.mark.slow

STEPS = 30
STEP_DELAY_S = 0.7
HANG_TIMEOUT_S = 3.0


def toy_config(path: Path) -> Path:
    data = {"job": {"name": "opskit", "kind": "toy"},
            "hardware": {"profile": "cpu", "nodes": 1, "gpus_per_node": 2},
            "placement": {"mode": "colocate"},
            "train": {"steps": STEPS, "step_delay_s": STEP_DELAY_S},
            "checkpoint": {"interval_steps": 10, "cost_s": 0.5},
            # A step's phases time out fast, a stale heartbeat of one is a hang within seconds; starting and
            # checkpointing on a loaded machine keep the default.
            "diag": {"hang_timeout_s": 120.0, "phase_timeouts_s": {"data": HANG_TIMEOUT_S, "train": HANG_TIMEOUT_S},
                     "heartbeat_interval_s": 0.2, "watch_interval_s": 0.25, "kill_grace_s": 2.0},
            "cluster": {"backend": "local", "time_limit_min": 5, "run_root": str(path.parent / "runs")}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def submit(tmp_path: Path) -> launch.Submission:
    config = toy_config(tmp_path / "opskit.yaml")
    return launch.submit(load_config(config), config_text=config.read_text())


def finish(sub: launch.Submission) -> list[int]:
    results = launch.wait(sub, timeout_s=240)
    return [int(r) for r in results] if isinstance(results, (list, tuple)) else [int(results or 0)]


def trained_steps(run: RunDir) -> int:
    return max((e.get("step") or 0 for e in events.read_events(run, events.CHECKPOINT_SAVED)), default=-1)


def diag_text(run: RunDir, tmp_path: Path) -> str:
    result = CliRunner().invoke(cli, ["diag", str(run.path), "--out", str(tmp_path / "bundles"), "--no-slurm"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_a_heartbeat_directory_turned_read_only_is_named_never_a_hang_and_the_job_finishes(tmp_path):
    sub = submit(tmp_path)
    run = RunDir(sub.run_dir)
    wait_for("both ranks past step 3", lambda: (beats := _beats(run, 2)) and all(
        (hb.get("step") or 0) >= 3 for hb in beats), timeout_s=120)
    with read_only(run.heartbeats) as expected:
        found = wait_for("heartbeat_unwritable of both ranks",
                         lambda: len(events.read_events(run, events.HEARTBEAT_UNWRITABLE)) == 2 and
                         events.read_events(run, events.HEARTBEAT_UNWRITABLE), timeout_s=30)
        assert {e["errno"] for e in found} == {expected} and {e["rank"] for e in found} == {0, 1}
        # Past the hang timeout with stale heartbeats: status shows why, no hang is called.
        time.sleep(HANG_TIMEOUT_S + 1)
        status = CliRunner().invoke(cli, ["status", str(run.path)])
        assert "cannot be written since " in status.output and os.strerror(expected) in status.output, status.output
        codes = finish(sub)
    assert codes == [0, 0]
    assert events.read_events(run, events.HANG_DETECTED) == [] and events.read_events(run, events.DONE)
    assert trained_steps(run) == STEPS
    out = diag_text(run, tmp_path)
    assert "heartbeat cannot be written: train-0" in out and os.strerror(expected) in out, out


def _beats(run: RunDir, n: int) -> list[dict]:
    from rlslurm.diag.heartbeat import read_heartbeats

    beats = [hb for hb in read_heartbeats(run) if hb.get("role") == "train"]
    return beats if len(beats) == n else []


def test_a_killed_node_agent_is_named_restarted_and_the_job_finishes(tmp_path):
    sub = submit(tmp_path)
    run = RunDir(sub.run_dir)
    first = wait_for("the node agent", lambda: node_agent(run.path), timeout_s=120)
    # After the attempt's `start` event: what status and diag show is the current attempt's.
    wait_for("the start event", lambda: events.read_events(run, events.START), timeout_s=120)
    first.send_signal(signal.SIGKILL)
    (died,) = wait_for("node_agent_died", lambda: events.read_events(run, events.NODE_AGENT_DIED), timeout_s=30)
    assert (died["agent_pid"], died["signal"], died["restarted"]) == (first.pid, "SIGKILL", True)
    second = wait_for("a new node agent", lambda: (a := node_agent(run.path)) is not None and a.pid != first.pid and a,
                      timeout_s=30)
    status = CliRunner().invoke(cli, ["status", str(run.path)])
    assert f"node agent pid {first.pid} on {died['node']} killed by SIGKILL at " in status.output, status.output
    assert finish(sub) == [0, 0] and trained_steps(run) == STEPS
    wait_for("the new agent gone with its job", lambda: not second.is_running() or
             second.status() == psutil.STATUS_ZOMBIE, timeout_s=30)
    out = diag_text(run, tmp_path)
    assert f"node agent died: pid {first.pid} on {died['node']} killed by SIGKILL; restarted" in out, out

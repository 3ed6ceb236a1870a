"""Engines that fail are replaced while the job runs (issue 19, part 1), on the real local Slurm: an RL het job
with two engines on its rollout node (two tasks of the rollout component, each an engine supervisor,
rlslurm/rollout/supervisor.py, around its server). Default rollout settings (rollout.hang_timeout_s 15 s).

One job, two faults: engine 0's server SIGKILLed while the controller's rollout runs, then engine 1's
SIGSTOPped while a later rollout runs. Each time the step completes with every sample it asked for, the
engine is replaced inside the allocation and VERIFIED at the current weight version before it takes traffic
again, and nothing is requeued; the hang is detected within its hang timeout + 5 s and named as the engine
(event and `rlslurm diag`).

    RLSLURM_SLURM_PORT_BASE=43817 python -m pytest -q -s tests/cluster/test_engine_failover_slurm.py   # ~2 min
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import spine_util as su
from rlslurm.cli.main import cli
from rlslurm.config import load_config
from rlslurm.rundir import read_jsonl
from waiting import wait_for

pytestmark = pytest.mark.cluster

PROMPTS, SAMPLES, STEPS = 32, 8, 5
HANG_TIMEOUT_S = load_config(Path(__file__).resolve().parents[2] / "examples" / "tiny-grpo.yaml").rollout.hang_timeout_s
"""The default the SIGSTOP must be detected within (+ 5 s)."""


def _config(path: Path, run_root: Path, engines: int = 2) -> Path:
    """2 trainer ranks on a train node, 2 engines on a rollout node; rollouts long enough (48 tokens x 256
    samples, ~1-3 s) to be caught in the middle; a fast heartbeat so the test sees the rollout phase at once."""
    data = {
        "job": {"name": path.stem, "kind": "rl"},
        "hardware": {"profile": "cpu", "nodes": 2, "gpus_per_node": 2},
        "placement": {"mode": "separate", "rollout_nodes": 1},
        "train": {"steps": STEPS, "seed": 0},
        "rl": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES, "eval_every": 100, "max_staleness": 0},
        "rollout": {"engines": engines, "max_new_tokens": 48},
        "task": {"eval_size": 16},
        "sync": {"method": "broadcast"},
        "diag": {"heartbeat_interval_s": 0.2},
        "checkpoint": {"interval_steps": 1000, "kill_wait_s": su.KILL_WAIT_S, "cost_s": 0.5},
        "cluster": {"backend": "slurm", "time_limit_min": 10, "run_root": str(run_root)},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _steps(run: Path) -> list[dict]:
    return [m for m in read_jsonl(run / "metrics.jsonl") if "policy_version" in m]


def _json(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return {}


def _in_rollout(run: Path, step: int) -> bool:
    """The controller (train rank 0) is in the rollout phase of step >= `step` (its heartbeat)."""
    hb = _json(run / "heartbeats" / "train-0.json")
    return hb.get("phase") == "rollout" and (hb.get("step") or 0) >= step


def _fault(run: Path, engine: int, step: int, sig: int, kick) -> tuple[int, float]:
    """`sig` to engine `engine`'s server while the rollout of step >= `step` runs; (pid, when)."""
    record = wait_for(f"engine {engine} serving", lambda: (
        r := _json(run / "endpoints" / f"engine-{engine}.json")).get("state") == "serving" and r, 180, on_poll=kick)
    wait_for(f"the rollout of step {step}", lambda: _in_rollout(run, step), 180, poll_s=0.02, on_poll=kick)
    os.kill(record["pid"], sig)
    return record["pid"], time.time()


def test_killed_and_stopped_engines_are_replaced_inside_the_allocation(slurm_cluster, tmp_path):
    sub = su.submit(_config(tmp_path / "rl-failover.yaml", tmp_path / "runs"))
    run, stopped = sub.run_dir, None
    try:
        killed, _ = _fault(run, 0, 2, signal.SIGKILL, slurm_cluster.kick)
        wait_for("engine 0 readmitted", lambda: su.events(run, "engine_readmitted"), 180, on_poll=slurm_cluster.kick)
        stopped, stopped_at = _fault(run, 1, len(_steps(run)) + 1, signal.SIGSTOP, slurm_cluster.kick)
        su.wait_done(sub.job_id, run, 300, slurm_cluster.kick)
    finally:
        if stopped is not None:  # its supervisor killed it; never leave a stopped process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
    assert su.state(sub.job_id) == "COMPLETED"
    assert not su.events(run, "requeue") and len(su.events(run, "start")) == 1  # inside the allocation
    steps = _steps(run)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(m["samples"] == PROMPTS * SAMPLES for m in steps), [m["samples"] for m in steps]
    assert not su.events(run, "engine_failed")

    # SIGKILL: died, its prompts re-sent mid-rollout, replaced, back after a VERIFIED sync to the current version.
    (died,) = su.events(run, "engine_died")
    assert (died["engine"], died["pid"], died["exit_code"]) == (0, killed, -signal.SIGKILL) and died["node"]
    # SIGSTOP with default settings: detected within its hang timeout + 5 s, naming engine, node, pid, cause.
    (hung,) = su.events(run, "engine_unhealthy")
    assert (hung["engine"], hung["pid"], hung["process_state"]) == (1, stopped, "stopped")
    assert hung["node"] == died["node"] and "no healthy /health answer" in hung["cause"]
    detected_s = hung["t"] - stopped_at
    assert detected_s <= HANG_TIMEOUT_S + 5, detected_s
    out = su.events(run, "engine_out")
    assert [e["engine"] for e in out] == [0, 1] and all(e["resent"] > 0 for e in out), out
    restarted = su.events(run, "engine_restarted")
    assert [(e["engine"], e["reason"]) for e in restarted] == [(0, "died"), (1, "hung")]
    readmitted = su.events(run, "engine_readmitted")
    assert [e["engine"] for e in readmitted] == [0, 1]
    verified = {e["version"]: e["t"] for e in su.events(run, "sync_verified")}
    for back, new in zip(readmitted, restarted):
        assert new["t"] < verified[back["version"]] <= back["t"], (back, new)
        assert back["version"] == max(v for v, t in verified.items() if t <= back["t"])  # the current version
    assert sum(m["prompts_resent"] for m in steps) == sum(e["resent"] for e in out) > 0
    # Metrics per step (taken as the rollout ends): one engine alive in the two steps that lost one, restarts
    # counted as they happen.
    assert [m["engines_alive"] for m in steps if m["prompts_resent"]] == [1, 1]
    assert {m["engines_alive"] for m in steps if not m["prompts_resent"]} == {2}
    restarts = [m["engine_restarts"] for m in steps]
    assert restarts == sorted(restarts) and restarts[-1] >= 1, restarts
    # `rlslurm diag` names the hung engine (the job itself finished).
    result = CliRunner().invoke(cli, ["diag", str(run), "--out", str(tmp_path / "bundles")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"engine 1 hung (on {hung['node']}, pid {stopped}, process state stopped)" in result.output, result.output
    print(f"\nMEASURE engine failover: SIGSTOP detected in {detected_s:.1f} s (hang timeout {HANG_TIMEOUT_S:g} s); "
          f"restarts {[e['start_s'] for e in restarted]} s; prompts re-sent {[e['resent'] for e in out]}")


def test_a_lone_engine_killed_then_stopped_is_replaced_and_verified_while_the_trainer_waits(slurm_cluster, tmp_path):
    """Issue 28, case 1, on the het job with the default rollout.engines 1: its server SIGKILLed mid-rollout, then
    SIGSTOPped mid-rollout. Before, the job failed (engine_failed, then rank 1's gloo 'Connection closed by
    peer', FAILED 143:0). Now the controller waits for the supervisor's replacement, forms the broadcast group
    anew with it, syncs and VERIFIES it, and the step goes on: COMPLETED, every step once, in one allocation."""
    sub = su.submit(_config(tmp_path / "rl-lone.yaml", tmp_path / "runs", engines=1))
    run, stopped = sub.run_dir, None
    try:
        killed, killed_at = _fault(run, 0, 2, signal.SIGKILL, slurm_cluster.kick)
        wait_for("engine 0 readmitted", lambda: su.events(run, "engine_readmitted"), 180, on_poll=slurm_cluster.kick)
        stopped, stopped_at = _fault(run, 0, len(_steps(run)) + 1, signal.SIGSTOP, slurm_cluster.kick)
        su.wait_done(sub.job_id, run, 300, slurm_cluster.kick)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
    assert su.state(sub.job_id) == "COMPLETED"
    assert not su.events(run, "requeue") and len(su.events(run, "start")) == 1  # inside the allocation
    assert not su.events(run, "engine_failed")
    assert [m["step"] for m in _steps(run)] == list(range(1, STEPS + 1))
    readmitted = su.events(run, "engine_readmitted")
    (hung,) = su.events(run, "engine_unhealthy")
    assert len(readmitted) == 2 and hung["process_state"] == "stopped"
    verified = {e["version"]: e["t"] for e in su.events(run, "sync_verified")}
    for back, new in zip(readmitted, su.events(run, "engine_restarted")):
        assert new["t"] < verified[back["version"]] <= back["t"], (back, new)
    wait_for("no process of the run left", lambda: not su.leftovers(run), 30, poll_s=0.5)
    print(f"\nMEASURE lone engine (het job): SIGKILL -> readmitted {readmitted[0]['t'] - killed_at:.1f} s; SIGSTOP -> "
          f"named {hung['t'] - stopped_at:.1f} s (hang timeout {HANG_TIMEOUT_S:g} s) -> readmitted "
          f"{readmitted[1]['t'] - stopped_at:.1f} s")

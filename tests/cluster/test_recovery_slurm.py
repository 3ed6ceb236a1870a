"""Recovery, the held-out round (issue 38), on the real local Slurm: an RL het job (2 trainer ranks on a train node,
its engines on a rollout node) meets each fault a fault-injection round found it losing to, and goes on:

- `rollout.engines: 2`, engine 0 killed past its restart budget: engine 0's task ends alone (exit 0, its srun
  step no longer ends its sibling), the controller takes it out for good and engine 1 serves every step to
  COMPLETED; `rlslurm status` and `rlslurm diag` name every engine. Before: srun's --kill-on-bad-exit took the
  healthy engine down and the job FAILED.
- `scancel --signal=TERM --full`: SLURM signals the batch step alone; srun, in a session of its own now, no
  longer answers with "forcing job termination" (SIGKILL of every rank), and the trainer supervisor passes the
  SIGTERM on to every component, so every rank and role drains; the drain checkpoint is written and the job,
  requeued, resumes at that step with no step made twice; diag says preemption, not "trainer rank crash".
- the checkpoints directory read-only for 20 s across a save (a read-only bind mount: EROFS, as root meets a
  refusing storage): each failed try a `checkpoint_failed` event, the save skipped, training on, `latest` the
  newest complete one throughout; COMPLETED in one allocation. Before: no event, no retry, the job FAILED.
- a full disk (the run root a tmpfs, filled, then to its last byte once a save met it): `checkpoint_failed`
  (disk_full), the job ends; diag says disk_full; space freed, `rlslurm resume` finishes it, and every line of
  every JSON-lines file of the run parses (appends that met ENOSPC took back what they wrote).
- `scontrol suspend` past the phase timeouts: the reward service and the node agent stop with the ranks; on
  `scontrol resume` the agent knows it did not see that time (`job_suspended`) and calls no hang (before: a
  hang on the resume, and a requeue).

    RLSLURM_SLURM_PORT_BASE=20817 python -m pytest -q -s tests/cluster/test_recovery_slurm.py   # ~6 min

Each prints a MEASURE line (-s) with the seconds the fault table of docs/ops-kit.md quotes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from click.testing import CliRunner

import spine_util as su
from rlslurm.checkpoint import latest_complete, step_dirname
from rlslurm.cli.main import cli
from rlslurm.lifecycle import SLURM_SIGTERM
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.slurm import commands
from waiting import wait_for

pytestmark = pytest.mark.cluster

JOB_TIMEOUT_S = 360
"""Bound on one job of this module, a requeue included, on 2 shared cores."""
LIVE = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED")


def _config(path: Path, run_root: Path, *, steps: int, engines: int = 1, step_delay_s: float = 0.5,
            interval_steps: int = 1000, reward: dict | None = None, rollout: dict | None = None,
            checkpoint: dict | None = None) -> Path:
    """The RL het job from the embedded model's random init (what it learns does not matter here): 2 ranks on
    a train node, `engines` on a rollout node, small steps stretched by `step_delay_s`."""
    data = {
        "job": {"name": path.stem, "kind": "rl"},
        "hardware": {"profile": "cpu", "nodes": 2, "gpus_per_node": 2},
        "placement": {"mode": "separate", "rollout_nodes": 1},
        "train": {"steps": steps, "seed": 0, "step_delay_s": step_delay_s},
        "rl": {"prompts_per_step": 16, "samples_per_prompt": 4, "eval_every": 1000, "max_staleness": 0},
        "rollout": {"engines": engines, "max_new_tokens": 8, **(rollout or {})},
        "task": {"eval_size": 16},
        "sync": {"method": "broadcast"},
        "diag": {"heartbeat_interval_s": 0.5},
        "checkpoint": {"interval_steps": interval_steps, "kill_wait_s": su.KILL_WAIT_S, "cost_s": 0.5,
                       **(checkpoint or {})},
        "cluster": {"backend": "slurm", "time_limit_min": 10, "run_root": str(run_root)},
        **({"reward": reward} if reward else {}),
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _steps(run: Path) -> list[dict]:
    return [m for m in read_jsonl(RunDir(run).metrics) if "policy_version" in m]


def _json(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return {}


def _ended(job_id: str, run: Path, kick) -> str:
    """Wait until SLURM holds the job in a final state (not merely requeued); that state."""
    wait_for(f"job {job_id} ({run.name}) to end", lambda: su.state(job_id) not in LIVE, JOB_TIMEOUT_S, poll_s=0.5,
             on_poll=kick)
    return su.state(job_id)


def _cli(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _logs(run: Path, pattern: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run / "logs").rglob(pattern)) if p.is_file())


def test_an_engine_past_its_restart_budget_leaves_alone_and_the_other_serves_every_step(slurm_cluster, tmp_path):
    steps = 14
    sub = su.submit(_config(tmp_path / "rl-engine-budget.yaml", tmp_path / "runs", steps=steps, engines=2,
                            step_delay_s=1.0, rollout={"max_restarts": 1}))
    run = sub.run_dir
    first = wait_for("engine 0 serving", lambda: (r := _json(run / "endpoints" / "engine-0.json")).get(
        "state") == "serving" and r, 180, on_poll=slurm_cluster.kick)
    wait_for("step 1", lambda: _steps(run), 180)
    healthy = _json(run / "endpoints" / "engine-1.json")
    assert healthy["state"] == "serving", healthy
    os.kill(first["pid"], signal.SIGKILL)
    second = wait_for("engine 0's replacement serving", lambda: (r := _json(run / "endpoints" / "engine-0.json")).get(
        "state") == "serving" and r["pid"] != first["pid"] and r, 120, poll_s=0.05)
    os.kill(second["pid"], signal.SIGKILL)  # past rollout.max_restarts = 1
    down_at = time.time()
    state = _ended(sub.job_id, run, slurm_cluster.kick)

    assert state == "COMPLETED", (state, _logs(run, "rollout-*.log")[-3000:])
    assert [m["step"] for m in _steps(run)] == list(range(1, steps + 1))
    assert all(m["samples"] == 16 * 4 for m in _steps(run))
    assert not su.events(run, "requeue") and len(su.events(run, "start")) == 1 and not su.events(run, "engine_failed")
    (down,) = su.events(run, "engine_down")
    assert (down["engine"], down["restarts"], down["max_restarts"]) == (0, 1, 1)
    (gone,) = [e for e in su.events(run, "engine_out") if "past rollout.max_restarts" in e["cause"]]
    assert gone["engine"] == 0
    # Engine 1 served throughout: the same server from the first step to the last, never died, never out.
    assert _json(run / "endpoints" / "engine-1.json")["pid"] == healthy["pid"]
    assert not [e for e in su.events(run) if e.get("engine") == 1 and e["kind"] in (
        "engine_died", "engine_unhealthy", "engine_out", "engine_down")]
    after = [m for m in _steps(run) if m["t"] > gone["t"]]
    assert after and all(m["engines_alive"] == 1 for m in after), after
    # Each engine's task ended by itself, exit 0: engine 0 past its budget, engine 1 at the job's end.
    engine_logs = _logs(run, "rollout-*.log")
    assert "failed past rollout.max_restarts = 1" in engine_logs and engine_logs.count("exiting 0") == 2
    assert "Killed" not in _logs(run, "submitit/*.err") and "forcing job termination" not in _logs(run, "*")

    status = _cli("status", str(run))
    assert "engine 0 down past rollout.max_restarts = 1" in status and "serving: engine 1 (1 of 2)" in status, status
    assert ": running:" not in status and "ended: finished" in status, status
    said = _cli("diag", str(run), "--out", str(tmp_path / "bundles"))
    assert "cause: finished OK" in said, said
    assert "engine 0: 2 deaths, 1 replacement by its supervisor, down past rollout.max_restarts = 1" in said, said
    assert "engine 1: served throughout (no death, no hang, never out of rotation)" in said, said
    print(f"\nMEASURE engine past its budget (2 engines, het job): second kill -> engine_down "
          f"{down['t'] - down_at:.1f} s -> out of rotation {gone['t'] - down['t']:.1f} s; {len(after)} steps on "
          f"engine 1 alone, {steps}/{steps} steps, COMPLETED; load {open('/proc/loadavg').read().split()[0]}")


def test_sigterm_to_the_whole_job_drains_every_role_and_the_requeued_job_resumes_at_that_step(slurm_cluster,
                                                                                             tmp_path):
    steps = 14
    sub = su.submit(_config(tmp_path / "rl-sigterm.yaml", tmp_path / "runs", steps=steps, interval_steps=4,
                            reward={"service": "component", "partition": "cpu", "batch_size": 64}))
    run = sub.run_dir
    wait_for("RL step 5", lambda: len(_steps(run)) >= 5, 240, on_poll=slurm_cluster.kick)
    signalled_at = time.time()
    commands.scancel(sub.job_id, signal="TERM", full=True)  # SLURM signals the batch step alone
    (drained,) = wait_for("the drain", lambda: su.events(run, "drained"), 60)
    step = drained["step"]
    before_requeue = _ended(sub.job_id, run, slurm_cluster.kick)
    said = _cli("diag", sub.job_id, "--run-root", str(run.parent), "--out", str(tmp_path / "bundles"))
    assert "cause: preempted by SLURM: SIGTERM to the job" in said and f"drained at step {step}" in said, said
    assert "trainer rank crash" not in said, said

    commands.requeue(sub.job_id)
    su.wait_done(sub.job_id, run, JOB_TIMEOUT_S, slurm_cluster.kick)

    assert (drained["signal"], drained["requeued"], drained["checkpoint"]) == ("SIGTERM", SLURM_SIGTERM,
                                                                               step_dirname(step))
    relayed = su.events(run, "job_sigterm")[0]
    assert len(relayed["components"]) == 3 and set(relayed["relayed"].values()) == {"signalled"}, relayed
    requested = [e for e in su.events(run, "drain_requested") if e.get("role") == "train"]
    assert requested and {e["signal"] for e in requested} == {"SIGTERM"}, requested
    # Every role got the SIGTERM and ended by itself, in both starts: the engine, the reward service; no srun SIGKILL.
    assert _logs(run, "rollout-*.log").count("stopped: exiting 0") == 2, _logs(run, "rollout-*.log")[-2000:]
    assert _logs(run, "reward-*.log").count("stopped: exiting 0") == 2, _logs(run, "reward-*.log")[-2000:]
    everything = _logs(run, "*")
    assert "forcing job termination" not in everything and ": Killed" not in everything
    assert not su.events(run, "reward_service_died")
    # Resumed at the drained step; no step made twice, none lost.
    (resume,) = su.events(run, "resume")
    assert (resume["step"], resume["checkpoint"], resume["restart_count"]) == (step, step_dirname(step), 1)
    made = [m["step"] for m in _steps(run)]
    assert made == list(range(1, steps + 1)), made
    assert max(m["step"] for m in _steps(run) if m["restart_count"] == 0) == step
    done = _cli("diag", str(run), "--out", str(tmp_path / "bundles2"))
    assert "cause: finished OK" in done and (f"earlier attempt: preempted by SLURM (SIGTERM): drained at step "
                                             f"{step}, checkpoint {step_dirname(step)}") in done, done
    print(f"\nMEASURE scancel --signal=TERM --full: drained at step {step}, {drained['t'] - signalled_at:.1f} s after "
          f"the signal (KillWait {su.KILL_WAIT_S} s), job ended {before_requeue}; requeue -> resumed at step "
          f"{resume['step']}; {steps}/{steps} steps, none twice; load {open('/proc/loadavg').read().split()[0]}")


@contextlib.contextmanager
def _read_only(path: Path):
    """A read-only bind mount over `path` (root): every write below it meets EROFS, reads work."""
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_checkpoints_unwritable_for_20s_across_a_save_are_survived(slurm_cluster, tmp_path):
    steps = 16
    sub = su.submit(_config(tmp_path / "rl-ro-checkpoints.yaml", tmp_path / "runs", steps=steps, step_delay_s=1.0,
                            interval_steps=2))
    run = RunDir(sub.run_dir)
    wait_for("the first checkpoint", lambda: (run.checkpoints / "latest").is_file(), 240, on_poll=slurm_cluster.kick)
    good = (run.checkpoints / "latest").read_text().strip()
    with _read_only(run.checkpoints):
        refused_at = time.time()
        wait_for("20 s of refused writes", lambda: time.time() - refused_at >= 20, 30, poll_s=0.5)
        during = (run.checkpoints / "latest").read_text().strip()
    back_at = time.time()
    state = _ended(sub.job_id, run.path, slurm_cluster.kick)

    assert state == "COMPLETED", state
    assert during == good  # `latest` stayed the newest complete checkpoint through the refusals
    failed = su.events(run.path, "checkpoint_failed")
    assert failed and all(e["errno"] == "EROFS" and "Read-only file system" in e["error"] for e in failed), failed
    assert {e["newest_complete"] for e in failed} == {good}, failed
    skipped = su.events(run.path, "checkpoint_save_skipped")
    assert skipped and not any(e["stopping"] for e in skipped), skipped
    assert all(e["attempts"] == 3 for e in skipped) and skipped[0]["failed_saves"] == 1
    saved_after = [e for e in su.events(run.path, "checkpoint_saved") if e["t"] > back_at]
    assert saved_after, "no checkpoint written once the storage took writes again"
    assert [m["step"] for m in _steps(run.path)] == list(range(1, steps + 1))
    assert len(su.events(run.path, "start")) == 1 and not su.events(run.path, "requeue")
    assert latest_complete(run, tidy=False).step == steps and not list(run.checkpoints.glob(".tmp-*"))
    first_try = failed[0]["t"] - refused_at
    print(f"\nMEASURE checkpoints read-only 20 s: first refused try {first_try:.1f} s into the window, "
          f"{len(failed)} failed tries, {len(skipped)} saves skipped, next save {saved_after[0]['t'] - back_at:.1f} s "
          f"after the storage came back (step {saved_after[0]['step']}); COMPLETED {steps}/{steps}, one allocation; "
          f"load {open('/proc/loadavg').read().split()[0]}")


@contextlib.contextmanager
def _tmpfs(path: Path, size_mib: int):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _every_line_parses(run: Path) -> dict[str, int]:
    """Every line of every JSON-lines file of the run, parsed strictly (a torn or run-on line raises)."""
    counts = {}
    for path in sorted(run.rglob("*.jsonl")):
        lines = path.read_bytes().split(b"\n")
        assert lines[-1] == b"", f"{path} does not end in a newline"
        for n, line in enumerate(lines[:-1], 1):
            try:
                json.loads(line)
            except ValueError as e:
                raise AssertionError(f"{path}:{n} is no JSON line ({e}): {line[:200]!r}") from e
        counts[path.name] = len(lines) - 1
    return counts


def test_a_full_disk_is_named_and_the_run_resumed_once_space_is_freed_has_every_line_whole(slurm_cluster, tmp_path):
    steps = 12
    root = tmp_path / "runs"
    with _tmpfs(root, 48):
        sub = su.submit(_config(tmp_path / "rl-disk-full.yaml", root, steps=steps, interval_steps=2,
                                checkpoint={"max_failed_saves": 1, "retry_backoff_s": 1.0}))
        run = RunDir(sub.run_dir)
        wait_for("the first checkpoint", lambda: (run.checkpoints / "latest").is_file(), 240,
                 on_poll=slurm_cluster.kick)
        ckpt_bytes = sum(p.stat().st_size for p in latest_complete(run, tidy=False).path.iterdir())
        stat = os.statvfs(root)
        leave = ckpt_bytes // 3  # room for events and logs, not for a checkpoint
        filler = root / "filler"
        with open(filler, "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
        filled_at = time.time()
        # Once a save has met the full disk, the last bytes go too: every append of the run meets ENOSPC now
        # (where the lines of events.jsonl and metrics.jsonl were torn before).
        wait_for("a failed save", lambda: su.events(run.path, "checkpoint_failed"), 120)
        with contextlib.suppress(OSError), open(root / "filler-2", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
        state = _ended(sub.job_id, run.path, slurm_cluster.kick)
        ended_at = time.time()
        assert state == "FAILED", state
        failed = su.events(run.path, "checkpoint_failed")
        # torch.save says ENOSPC without its errno ("PytorchStreamWriter failed writing file"): the free space tells.
        assert failed and failed[0]["disk_full"] and failed[0]["free_bytes"] < (1 << 20), failed[0]
        good = failed[0]["newest_complete"]  # `latest` when the disk filled: complete, and what resume takes
        assert good and (run.checkpoints / good / "manifest.json").is_file(), failed[0]
        # Past checkpoint.max_failed_saves the job stops by itself (test_checkpoint_storage_faults.py); here the
        # disk is left no byte, so its own word of that cannot be written: it must end all the same.
        said = _cli("diag", str(run.path), "--out", str(tmp_path / "bundles"))
        assert re.search(r"cause: no space left on device while checkpointing step \d+", said), said
        assert f"the newest complete checkpoint {good} is intact" in said, said
        status = _cli("status", str(run.path))  # the save that met the full disk, not a peer's echo of it
        assert "No space left on device" in status and "Connection closed by peer" not in status, status

        filler.unlink()  # space freed
        (root / "filler-2").unlink()
        resumed = _cli("resume", str(run.path))
        job = re.search(r"submitted slurm job (\d+)", resumed).group(1)
        su.TRACKED.append((job, run.path))
        su.wait_done(job, run.path, JOB_TIMEOUT_S, slurm_cluster.kick)
        counts = _every_line_parses(run.path)
        (again,) = su.events(run.path, "resume")
        assert again["checkpoint"] == good, (again, good)
        assert sorted({m["step"] for m in _steps(run.path)}) == list(range(1, steps + 1))
        assert len(su.events(run.path, "submitted")) == 2 and su.events(run.path, "done")
        print(f"\nMEASURE full disk: first failed save {failed[0]['t'] - filled_at:.1f} s after the fill "
              f"({failed[0]['free_bytes']} bytes free), job ended {ended_at - filled_at:.1f} s after it (FAILED, "
              f"{len(failed)} failed tries said); resumed from {again['checkpoint']} to {steps}/{steps} steps; "
              f"lines {counts}; load {open('/proc/loadavg').read().split()[0]}")
        wait_for("no process of the run left", lambda: not su.leftovers(run.path), 60, poll_s=0.5)
        shutil.rmtree(run.path / "checkpoints", ignore_errors=True)


def test_a_suspended_job_stops_its_helpers_and_raises_no_hang_on_resume(slurm_cluster, tmp_path):
    """`scontrol suspend` for three times the phase timeouts, then `scontrol resume`: the reward service beside
    the controller and the node agent are stopped with the ranks (SLURM stops every process of the step's tree,
    sessions of their own too, SIGSTOP ~2 s after SIGTSTP: measured), and on the resume the agent knows it did
    not see that time (`job_suspended`, `unobserved_s`) and calls no hang; the job goes on in its allocation.
    Before (5e8c18c): once resumed, the agent found every rank 24 s past its 8 s timeout, called a hang and
    requeued the job."""
    steps, timeout_s = 10, 8.0
    config = _config(tmp_path / "rl-suspend.yaml", tmp_path / "runs", steps=steps, step_delay_s=1.0,
                     reward={"service": "local", "batch_size": 64})
    data = yaml.safe_load(config.read_text())
    # Short timeouts where the ranks spend the step (the step delay is `train`); the engine's and the reward's
    # phases keep theirs, which the timeout chain wants above their requests' own.
    data["diag"] = {"heartbeat_interval_s": 0.5, "watch_interval_s": 0.5,
                    "phase_timeouts_s": {"train": timeout_s, "wait_experience": timeout_s, "data": timeout_s}}
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    sub = su.submit(config)
    run = sub.run_dir
    wait_for("RL step 3", lambda: len(_steps(run)) >= 3, 240, on_poll=slurm_cluster.kick)
    helpers = {"reward service": _json(run / "heartbeats" / "reward-0.json")["pid"],
               "node agent": next(p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and
                                  "rlslurm.diag.watchdog" in p.info["cmdline"] and str(run) in p.info["cmdline"])}
    commands.scontrol("suspend", sub.job_id)
    suspended_at = time.time()
    try:
        for name, pid in helpers.items():
            wait_for(f"the {name} stopped with the ranks", lambda pid=pid: psutil.Process(pid).status() in (
                psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP), 10, poll_s=0.1)
        wait_for(f"{3 * timeout_s:g} s suspended", lambda: time.time() - suspended_at >= 3 * timeout_s, 60,
                 poll_s=0.5)
    finally:
        commands.scontrol("resume", sub.job_id)  # a suspended job left behind stops every later one
        resumed_at = time.time()
    state = _ended(sub.job_id, run, slurm_cluster.kick)

    assert not su.events(run, "hang_detected"), su.events(run, "hang_detected")  # before: a hang, then a requeue
    assert state == "COMPLETED" and not su.events(run, "requeue"), state
    (said,) = su.events(run, "job_suspended")
    # The agent stops a moment after the ranks (measured 1-2 s): what it did not see is past every timeout.
    assert said["unobserved_s"] > 2 * timeout_s and {"train-0", "train-1"} <= set(said["ranks"]), said
    assert [m["step"] for m in _steps(run)] == list(range(1, steps + 1)) and len(su.events(run, "start")) == 1
    assert not su.events(run, "reward_service_unhealthy") and not su.events(run, "reward_service_died")
    print(f"\nMEASURE scontrol suspend {resumed_at - suspended_at:.0f} s (phase timeout {timeout_s:g} s): reward "
          f"service and node agent stopped with the ranks; on the resume the agent said {said['unobserved_s']} s "
          f"unobserved, no hang; COMPLETED {steps}/{steps}; load {open('/proc/loadavg').read().split()[0]}")

"""Drain, kill, corrupt, restart: the toy DDP job (2 real processes over gloo) must end where an
uninterrupted run ends — same per-step losses, same final weights checksum.

    python -m pytest -q -s tests/integration/test_toytrain_resume.py   # -s prints the measured timings
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlslurm.checkpoint import latest_complete
from rlslurm.events import read_events
from rlslurm.lifecycle import ExitCode
from rlslurm.rundir import RunDir, read_jsonl
from waiting import wait_for

STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, *args: str, world: int = 2, restart: int = 0,
           env: dict | None = None) -> list[subprocess.Popen]:
    port = str(_free_port())
    procs = []
    for rank in range(world):
        e = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RLSLURM_RESTART_COUNT": str(restart),
             "PYTHONUNBUFFERED": "1", **(env or {})}
        for key in ("SLURM_JOB_ID", "RLSLURM_LEADER_JOB_ID"):
            e.pop(key, None)
        log = open(run_dir.parent / f"{run_dir.name}-r{restart}-rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "rlslurm.jobs.toytrain", "--run-dir", str(run_dir),
                                       *args], env=e, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout_s: float = 90) -> list[int]:
    return [p.wait(timeout=timeout_s) for p in procs]


def losses(run: RunDir) -> dict[int, float]:
    """step -> loss; a step run twice (after a resume from an older checkpoint) keeps its last value."""
    return {m["step"]: m["loss"] for m in read_jsonl(run.metrics) if "loss" in m}


def final_sha(run: RunDir) -> str:
    finals = [m for m in read_jsonl(run.metrics) if m.get("final")]
    assert finals, f"no final record in {run.metrics}"
    return finals[-1]["weights_sha256"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> RunDir:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    assert wait_all(launch(run_dir, "--steps", str(STEPS), "--interval-steps", "10")) == [0, 0]
    run = RunDir(run_dir)
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    return run


def test_sigusr1_drains_all_ranks_at_one_step_and_resume_is_exact(tmp_path, reference):
    run = RunDir(tmp_path / "run")
    procs = launch(run.path, "--steps", str(STEPS), "--interval-steps", "10", "--step-delay-s", "0.1")
    wait_for("step 7 in metrics.jsonl", lambda: max(losses(run), default=0) >= 7, poll_s=0.02)
    signalled = time.monotonic()
    procs[1].send_signal(signal.SIGUSR1)  # only rank 1: rank 0 must learn it through the all_reduce
    codes = wait_all(procs)
    drain_s = time.monotonic() - signalled
    assert codes == [ExitCode.DRAINED, ExitCode.DRAINED]

    (drained,) = read_events(run, "drained")
    step = drained["step"]
    assert 7 <= step < STEPS and drained["checkpoint"] == f"step-{step:08d}"
    assert drained["signal"] == "SIGUSR1" and drained["requeued"].startswith("not under SLURM")
    assert latest_complete(run).step == step
    assert max(losses(run)) == step

    launched = time.time()
    assert wait_all(launch(run.path, "--steps", str(STEPS), "--interval-steps", "10", restart=1)) == [0, 0]
    (resume,) = read_events(run, "resume")
    assert (resume["step"], resume["checkpoint"], resume["restart_count"]) == (step, f"step-{step:08d}", 1)
    first = read_events(run, "first_step")[-1]
    assert first["step"] == step + 1
    restart_to_first_step_s = [m for m in read_jsonl(run.metrics) if m.get("restart_count") == 1][0]["t"] - launched
    assert losses(run) == losses(reference)
    assert final_sha(run) == final_sha(reference)
    print(f"\n[timing] SIGUSR1 -> both ranks exited: {drain_s:.2f} s (drained at step {step}); "
          f"restart -> first step: {restart_to_first_step_s:.2f} s from launch, "
          f"{first['since_process_start_s']:.2f} s from process start")


def test_sigkill_while_writing_resumes_from_previous_complete(tmp_path, reference):
    run = RunDir(tmp_path / "run")
    procs = launch(run.path, "--steps", str(STEPS), "--interval-steps", "10",
                   env={"RLSLURM_TEST_PAUSE_IN_CHECKPOINT_S": "60@20"})
    tmp = wait_for("a half-written step-20 checkpoint", lambda: [
        p for p in run.checkpoints.glob(".tmp-step-00000020-*") if (p / "model.safetensors").is_file()], poll_s=0.02)
    procs[0].send_signal(signal.SIGKILL)  # the writer dies between its first file and its manifest
    procs[0].wait(timeout=30)
    try:
        procs[1].wait(timeout=30)  # gloo sees the peer gone and raises
    except subprocess.TimeoutExpired:
        procs[1].kill()  # as SLURM would end the rest of the step
        procs[1].wait()
    assert not (run.checkpoints / "step-00000020").exists() and tmp[0].exists()

    assert wait_all(launch(run.path, "--steps", str(STEPS), "--interval-steps", "10", restart=1)) == [0, 0]
    skipped = read_events(run, "checkpoint_skipped")
    assert [(e["checkpoint"], e["reason"].split(",")[0]) for e in skipped] == [
        (tmp[0].name, "incomplete: no manifest")]
    assert "dead" in skipped[0]["reason"] and not tmp[0].exists()
    (resume,) = read_events(run, "resume")
    assert resume["step"] == 10
    assert losses(run) == losses(reference)
    assert final_sha(run) == final_sha(reference)


def test_corrupt_newest_checkpoint_is_skipped(tmp_path, reference):
    run = RunDir(tmp_path / "run")
    assert wait_all(launch(run.path, "--steps", "20", "--interval-steps", "10")) == [0, 0]
    weights = run.checkpoints / "step-00000020" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum can tell
    weights.write_bytes(bytes(data))

    assert wait_all(launch(run.path, "--steps", str(STEPS), "--interval-steps", "10", restart=1)) == [0, 0]
    (skipped,) = read_events(run, "checkpoint_skipped")
    assert skipped["checkpoint"] == "step-00000020"
    assert skipped["reason"] == "sha256 mismatch in model.safetensors"
    assert (run.checkpoints / skipped["moved_to"]).is_dir()
    assert read_events(run, "resume")[0]["step"] == 10
    assert losses(run) == losses(reference)
    assert final_sha(run) == final_sha(reference)


def test_no_progress_guard_stops_the_requeue_storm(tmp_path):
    run = RunDir(tmp_path / "run")
    config = tmp_path / "job.yaml"
    config.write_text("checkpoint: {interval_steps: 100, max_no_progress_restarts: 2}\n")
    crash = {"RLSLURM_TEST_EXIT_AT_STEP": "3"}  # dies every time before its first checkpoint
    codes = [wait_all(launch(run.path, "--config", str(config), "--steps", "50", world=1, restart=r, env=crash))[0]
             for r in range(3)]
    assert codes == [-signal.SIGKILL, -signal.SIGKILL, ExitCode.NO_PROGRESS]
    (stop,) = read_events(run, "no_progress")
    assert stop["fruitless_starts"] == 2 and stop["restart_count"] == 2
    assert "max_no_progress_restarts = 2" in stop["reason"]
    assert [j["restart_count"] for j in read_jsonl(run.jobs)] == [0, 1, 2]
    assert max(losses(run)) == 3

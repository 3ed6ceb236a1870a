"""The SFT entrance stops and comes back: drained by SIGUSR1 or killed by SIGKILL mid-run, then started
again, two real ranks over gloo must end where an uninterrupted run ends: the same per-step losses, the
same final weights (checksum) and the same held-out accuracy of the export.

    python -m pytest -q -s tests/integration/test_sft_resume.py      # -s prints the measured restarts
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
import yaml

from rlslurm.checkpoint import latest_complete, step_dirname
from rlslurm.events import read_events
from rlslurm.lifecycle import NOT_UNDER_SLURM, ExitCode
from rlslurm.rundir import RunDir, read_jsonl
from waiting import wait_for as poll_for

WORLD = 2
STEPS = 80
INTERVAL = 10
CONFIG = {
    "job": {"name": "sft-resume", "kind": "sft"},
    "placement": {"mode": "colocate"},
    "hardware": {"nodes": 1, "gpus_per_node": WORLD},
    "train": {"steps": STEPS, "lr": 3.0e-3, "batch_size": 16, "warmup_steps": 5, "lr_schedule": "cosine",
              "seed": 0, "dist_timeout_s": 30},
    "task": {"train_size": 400, "eval_size": 20, "seed": 1234},
    "checkpoint": {"interval_steps": INTERVAL, "cost_s": 0.5},
}
RUN_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sft-config") / "sft.yaml"
    path.write_text(yaml.safe_dump(CONFIG, sort_keys=False))
    return path


def launch(config: Path, run_dir: Path, restart: int = 0) -> list[subprocess.Popen]:
    """The two ranks of one start of the job (RLSLURM_RESTART_COUNT tells the start guard which one)."""
    port = str(_free_port())
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RLSLURM_RESTART_COUNT": str(restart),
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for key in ("SLURM_JOB_ID", "RLSLURM_LEADER_JOB_ID"):
            env.pop(key, None)
        log = open(run_dir.parent / f"{run_dir.name}-r{restart}-rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "rlslurm.jobs.sft", "--config", str(config),
                                       "--run-dir", str(run_dir)], env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], run_dir: Path, restart: int) -> list[int]:
    try:
        return [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def logs(run_dir: Path, restart: int) -> str:
    return "\n---\n".join((run_dir.parent / f"{run_dir.name}-r{restart}-rank{r}.log").read_text()[-2000:]
                          for r in range(WORLD))


def wait_for(what: str, predicate):
    # A step of this run lasts ~10 ms: poll fast, so a SIGKILL lands where the test means it to.
    return poll_for(what, predicate, timeout_s=RUN_TIMEOUT_S, poll_s=0.005)


def losses(run: RunDir) -> dict[int, float]:
    """step -> loss; a step trained again after a resume from an older checkpoint keeps its last value."""
    return {m["step"]: m["loss"] for m in read_jsonl(run.metrics) if m.get("kind") == "sft_step"}


def last_step(run: RunDir) -> int:
    return max(losses(run), default=0)


def outcome(run: RunDir) -> dict:
    """What the finished job produced: final weights (both ranks agree) and the export's accuracy."""
    finished = read_events(run, "sft_finished")
    assert sorted(e["rank"] for e in finished) == list(range(WORLD)), finished
    assert len({e["weights_sha256"] for e in finished}) == 1
    (evaluated,) = [m for m in read_jsonl(run.metrics) if m.get("kind") == "sft_eval"]
    return {"weights_sha256": finished[0]["weights_sha256"], "correct": evaluated["held_out_correct"],
            "final_loss": losses(run)[STEPS]}


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory) -> RunDir:
    run_dir = tmp_path_factory.mktemp("sft-ref") / "run"
    codes = wait_all(launch(config, run_dir), run_dir, 0)
    assert codes == [0] * WORLD, f"exit codes {codes}\n{logs(run_dir, 0)}"
    run = RunDir(run_dir)
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    # Periodic checkpoints on the interval, the last one the trained state (kept: checkpoint.keep = 2).
    assert [e["step"] for e in read_events(run, "checkpoint_saved")] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert latest_complete(run, tidy=False).step == STEPS
    return run


def test_usr1_drains_both_ranks_at_one_step_and_the_restart_ends_like_the_reference(config, reference, tmp_path):
    run_dir = tmp_path / "run"
    run = RunDir(run_dir)
    procs = launch(config, run_dir)
    wait_for("step 20", lambda: last_step(run) >= 20 or any(p.poll() is not None for p in procs))
    procs[1].send_signal(signal.SIGUSR1)  # one rank only: the other learns it at the step boundary
    signalled_at = time.time()
    codes = wait_all(procs, run_dir, 0)
    assert codes == [ExitCode.DRAINED] * WORLD, f"exit codes {codes}\n{logs(run_dir, 0)}"
    (drained,) = read_events(run, "drained")
    step = drained["step"]
    assert 20 <= step < STEPS and drained["checkpoint"] == step_dirname(step)
    assert drained["signal"] == "SIGUSR1" and drained["reason"] == "rank 1: signal SIGUSR1"
    assert drained["requeued"] == NOT_UNDER_SLURM
    assert last_step(run) == step  # no rank trained past the drain step

    codes = wait_all(launch(config, run_dir, restart=1), run_dir, 1)
    assert codes == [0] * WORLD, f"exit codes {codes}\n{logs(run_dir, 1)}"
    (resume,) = read_events(run, "resume")
    assert (resume["step"], resume["checkpoint"], resume["restart_count"]) == (step, step_dirname(step), 1)
    assert losses(run) == losses(reference)
    assert outcome(run) == outcome(reference)
    first = min(m["t"] for m in read_jsonl(run.metrics) if m.get("kind") == "sft_step" and m["step"] == step + 1)
    print(f"\nMEASURE SFT USR1 drain at step {step}: signal -> training again {first - signalled_at:.2f} s "
          f"(exit, relaunch, imports, rendezvous, checkpoint load)")


def test_sigkill_mid_run_resumes_from_the_last_periodic_checkpoint_and_ends_like_the_reference(
        config, reference, tmp_path):
    run_dir = tmp_path / "run"
    run = RunDir(run_dir)
    procs = launch(config, run_dir)
    wait_for("a complete checkpoint at step 30",
             lambda: (run.checkpoints / "latest").is_file() and (run.checkpoints / "latest").read_text().strip()
             >= step_dirname(3 * INTERVAL) or any(p.poll() is not None for p in procs))
    os.kill(procs[0].pid, signal.SIGKILL)  # a node failure: no drain, no final checkpoint
    step_at_kill = last_step(run)
    codes = wait_all(procs, run_dir, 0)
    assert codes[0] == -signal.SIGKILL and codes[1] != 0, f"exit codes {codes}\n{logs(run_dir, 0)}"
    assert step_at_kill < STEPS, "the run finished before the kill"
    # The surviving rank's collective failed: the phase guard recorded where.
    (failed,) = [e for e in read_events(run, "phase_failed") if e["rank"] == 1]
    assert failed["phase"] in ("data", "train", "checkpoint", None) and failed["error"]

    codes = wait_all(launch(config, run_dir, restart=1), run_dir, 1)
    assert codes == [0] * WORLD, f"exit codes {codes}\n{logs(run_dir, 1)}"
    (resume,) = read_events(run, "resume")
    assert resume["step"] % INTERVAL == 0 and step_at_kill - INTERVAL <= resume["step"] <= step_at_kill, \
        (resume, step_at_kill)
    assert losses(run) == losses(reference)
    assert outcome(run) == outcome(reference)

"""The SFT entrance on the real local Slurm: submitted like the RL job, requeued by SLURM mid-run, resumed
from its last complete checkpoint by itself, and ending where the same job run off SLURM ends (same
per-step losses, same final weights, same held-out result of the export the RL job starts from).

    RLSLURM_SLURM_PORT_BASE=24817 python -m pytest -q -s tests/cluster/test_sft_slurm.py   # ~1.5 min
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

import spine_util as su
from exit_hold import plant_exit_hold
from rlslurm import launch
from rlslurm.checkpoint import step_dirname
from rlslurm.config import load_config
from rlslurm.lifecycle import SLURM_SIGTERM
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.slurm import commands

pytestmark = pytest.mark.cluster

STEPS = 60
INTERVAL = 10
JOB_TIMEOUT_S = 240


def sft_config(path: Path, run_root: Path, *, backend: str, step_delay_s: float = 0.0, **train) -> Path:
    path.write_text(yaml.safe_dump({
        "job": {"name": path.stem, "kind": "sft"},
        "placement": {"mode": "colocate"},
        "hardware": {"profile": "cpu", "nodes": 1, "gpus_per_node": 2},
        "train": {"steps": STEPS, "lr": 3.0e-3, "batch_size": 16, "warmup_steps": 5, "lr_schedule": "cosine",
                  "seed": 0, "dist_timeout_s": 600, "step_delay_s": step_delay_s, **train},
        "task": {"train_size": 400, "eval_size": 20, "seed": 1234},
        "checkpoint": {"interval_steps": INTERVAL, "cost_s": 0.5, "kill_wait_s": su.KILL_WAIT_S},
        "cluster": {"backend": backend, "time_limit_min": 5, "run_root": str(run_root)},
    }, sort_keys=False))
    return path


def sft_losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(RunDir(run).metrics) if m.get("kind") == "sft_step"}


def outcome(run: Path) -> dict:
    """Both ranks' final weights (they must agree) and the export's held-out result."""
    finished = su.events(run, "sft_finished")
    assert sorted(e["rank"] for e in finished) == [0, 1] and len({e["weights_sha256"] for e in finished}) == 1
    (evaluated,) = [m for m in read_jsonl(RunDir(run).metrics) if m.get("kind") == "sft_eval"]
    assert (Path(evaluated["export"]) / "model.safetensors").is_file()
    return {"weights_sha256": finished[0]["weights_sha256"], "correct": evaluated["held_out_correct"]}


def test_sft_requeued_by_slurm_resumes_and_ends_like_the_run_off_slurm(slurm_cluster, tmp_path):
    local = sft_config(tmp_path / "sft-local.yaml", tmp_path / "runs", backend="local")
    ref = launch.submit(load_config(local), config_text=local.read_text())
    assert launch.wait(ref, timeout_s=JOB_TIMEOUT_S, poll_s=0.5) == [0, 0]

    sub = su.submit(sft_config(tmp_path / "sft-slurm.yaml", tmp_path / "runs", backend="slurm", step_delay_s=0.1))
    assert sub.backend == "slurm"
    su.wait_for("SFT step 15 on SLURM", lambda: max(sft_losses(sub.run_dir), default=0) >= 15, JOB_TIMEOUT_S)
    (rec,) = commands.show_job(sub.job_id)
    assert rec["Partition"] == "train" and rec["NumNodes"] == "1"
    requeued_at = time.time()
    commands.requeue(sub.job_id)
    su.wait_for(f"SFT job {sub.job_id} COMPLETED", lambda: su.state(sub.job_id) == "COMPLETED", JOB_TIMEOUT_S,
                on_poll=slurm_cluster.kick, poll_s=0.25)

    (drained,) = su.events(sub.run_dir, "drained")
    assert drained["signal"] == "SIGTERM" and drained["requeued"] == SLURM_SIGTERM
    assert 15 <= drained["step"] < STEPS and drained["checkpoint"] == step_dirname(drained["step"])
    (resume,) = su.events(sub.run_dir, "resume")
    got = (resume["step"], resume["checkpoint"], resume["restart_count"])
    assert got == (drained["step"], drained["checkpoint"], 1)
    assert commands.show_job(sub.job_id)[0]["Restarts"] == "1"
    assert sft_losses(sub.run_dir) == sft_losses(ref.run_dir)
    assert sorted(sft_losses(sub.run_dir)) == list(range(1, STEPS + 1))
    assert outcome(sub.run_dir) == outcome(ref.run_dir)
    first = min(m["t"] for m in read_jsonl(RunDir(sub.run_dir).metrics)
                if m.get("kind") == "sft_step" and m["step"] == drained["step"] + 1 and m["t"] > requeued_at)
    started = min(p["t"] for p in su.placements(sub.run_dir, "train", 1))
    print(f"\nMEASURE SFT scontrol requeue at step {drained['step']}: requeue -> training again "
          f"{first - requeued_at:.2f} s (SLURM requeue -> processes start {started - requeued_at:.2f} s, "
          f"start -> first step {first - started:.2f} s)")




def test_a_rank_that_outlives_the_finished_job_is_ended_by_srun_wait_and_named(slurm_cluster, tmp_path, monkeypatch):
    """Issue 26 part 4 on SLURM: rank 1 is held at interpreter exit after its entrance returned (a sitecustomize
    on PYTHONPATH; the job's code is unchanged). srun's --wait=train.exit_grace_s (the trainer supervisor adds
    it) ends it; the supervisor names it (`rank_outlived_job`) and the job ends COMPLETED, not FAILED."""
    held = plant_exit_hold(tmp_path, monkeypatch, rank_var="SLURM_PROCID")
    grace_s = 5
    sub = su.submit(sft_config(tmp_path / "sft-held.yaml", tmp_path / "runs", backend="slurm", exit_grace_s=grace_s))
    su.wait_for(f"SFT job {sub.job_id} ended", lambda: su.state(sub.job_id) in ("COMPLETED", "FAILED", "CANCELLED"),
                JOB_TIMEOUT_S, on_poll=slurm_cluster.kick, poll_s=0.5)
    assert held.exists(), "rank 1 was never held at exit: the test planted nothing"
    assert su.state(sub.job_id) == "COMPLETED"
    (outlived,) = su.events(sub.run_dir, "rank_outlived_job")
    assert outlived["stuck_rank"] == 1 and outlived["grace_s"] == grace_s
    assert outlived["ended"].startswith("srun --wait=5") and outlived["node"], outlived
    finished = su.events(sub.run_dir, "sft_finished")
    assert sorted(e["rank"] for e in finished) == [0, 1]
    import psutil

    assert not psutil.pid_exists(int(held.read_text()))

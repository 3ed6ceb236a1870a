"""`train.backend: torch` computes where its process group reduces: on the CPU with gloo, on the rank's GPU
with NCCL (rlslurm/dist.py `compute_device`). NCCL reduces only GPU tensors, so a model, a batch or a
step-boundary flag left on the CPU would fail the first collective of a GPU job.

    python -m pytest -q tests/integration/test_torch_backend_device.py     # CPU: ~15 s; the gpu tests skip

The CPU test runs here and in CI; the `gpu` tests need a CUDA GPU (they have not run on one yet).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from rlslurm.config import JobConfig
from rlslurm.dist import Topology, free_port, init_process_group
from rlslurm.events import read_events
from rlslurm.rundir import RunDir, read_jsonl

SFT = {
    "job": {"name": "device", "kind": "sft"},
    "placement": {"mode": "colocate"},
    "hardware": {"nodes": 1, "gpus_per_node": 1},
    "train": {"steps": 6, "lr": 3.0e-3, "batch_size": 8, "seed": 0, "dist_timeout_s": 60},
    "task": {"train_size": 64, "eval_size": 8, "seed": 1234},
    "checkpoint": {"interval_steps": 3, "cost_s": 0.5},
}


def _sft(tmp_path: Path) -> RunDir:
    """One rank of the SFT job, to the end; its run directory."""
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(SFT, sort_keys=False))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    for key in ("SLURM_JOB_ID", "RLSLURM_LEADER_JOB_ID"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-m", "rlslurm.jobs.sft", "--config", str(config),
                           "--run-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = RunDir(tmp_path / "run")
    assert [m for m in read_jsonl(run.metrics) if m.get("kind") == "sft_eval"]
    return run


def test_sft_on_a_cpu_machine_trains_on_the_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_sft_on_a_gpu_machine_trains_on_the_gpu covers it")
    (start,) = read_events(_sft(tmp_path), "sft_start")
    assert start["device"] == "cpu"


@pytest.mark.gpu
def test_sft_on_a_gpu_machine_trains_on_the_gpu(tmp_path):
    (start,) = read_events(_sft(tmp_path), "sft_start")
    assert start["device"] == "cuda:0"


@pytest.mark.gpu
def test_rl_policy_update_runs_on_the_gpu_under_nccl(tmp_path):
    from rlslurm.diag.guard import PhaseGuard
    from rlslurm.rl.experience import Sample
    from rlslurm.rl.policy import Policy
    from rlslurm.tinymodel import build_model, save_hf
    from rlslurm.tokenizer import build_tokenizer

    job = JobConfig()
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, lr=1e-2, seed=0))
    save_hf(build_model(job.model, seed=0), tmp_path / "init")
    topo = Topology(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=free_port())
    init_process_group(topo, timeout_s=60)
    try:
        assert dist.get_backend() == "nccl"
        guard = PhaseGuard(RunDir(tmp_path / "run").create(), "train", 0, job.diag, faulthandler_fallback=False,
                           background=False)
        policy = Policy(job, topo, tmp_path / "init")
        assert {p.device.type for p in policy.model.parameters()} == {"cuda"}
        before = {k: v.clone() for k, v in policy.weights().items()}
        tok = build_tokenizer()
        prompt = list(tok("12+7=")["input_ids"])
        right, wrong = list(tok("19")["input_ids"]), list(tok("18")["input_ids"])
        # A fresh sample and a stale one (engine logprobs as the behaviour policy: the clipped-ratio path).
        samples = [Sample(prompt, right, 1.0, 1.0, 0, [0.0] * len(right)),
                   Sample(prompt, wrong, 0.0, -1.0, 0, [-0.5] * len(wrong), staleness=1)]
        stats = policy.update(samples, guard, step_total=2)
        assert stats["grad_norm"] > 0 and torch.isfinite(torch.tensor(stats["loss"]))
        assert any(not torch.equal(before[k], v) for k, v in policy.weights().items())
        guard.close()
    finally:
        dist.destroy_process_group()

"""Fixtures shared by the unit tests of the RL loss (test_grpo.py, test_rl_pipeline.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlslurm.config import JobConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology
from rlslurm.rl.policy import Policy
from rlslurm.rundir import RunDir
from rlslurm.tinymodel import build_model, save_hf


@pytest.fixture
def policy_and_guard(tmp_path):
    """A world-1 torch Policy of the embedded default at seed 0 (lr 1e-3) and a foreground phase guard."""
    job = JobConfig()
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, lr=1e-3, seed=0))
    save_hf(build_model(job.model, seed=0), tmp_path / "init")
    topo = Topology(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0)
    run = RunDir(tmp_path / "run").create()
    guard = PhaseGuard(run, "train", 0, job.diag, faulthandler_fallback=False, background=False)
    torch.manual_seed(0)
    yield Policy(job, topo, tmp_path / "init"), guard
    guard.close()

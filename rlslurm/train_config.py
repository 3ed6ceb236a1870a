"""`train:` in a job YAML: what both entrances (SFT and RL) share on the trainer side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    backend: Literal["torch", "megatron"] = "torch"
    """torch = DDP trainer (CPU default); megatron = Megatron-core (rlslurm/megatron/policy.py): job.kind rl
    only, a CUDA GPU on every trainer rank at run time (on CPU the job stops with an error naming the fix)."""
    steps: int = 20
    """Optimizer steps the job runs in total (across requeues)."""
    lr: float = 1e-3
    """Peak learning rate."""
    batch_size: int = 32
    """Sequences per optimizer step across all data-parallel ranks."""
    grad_clip: float = 1.0
    """Gradient-norm clipping; 0 = off."""
    init_from: str | None = None
    """HF-layout safetensors checkpoint to start from; null = the embedded model at random init."""
    seed: int = 0
    """Seed of every RNG (data order, init, sampling)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: constant = stay at train.lr; cosine = decay to 0 at train.steps."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to train.lr."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    dist_timeout_s: float = 120.0
    """Seconds a rank waits for its peers in the process group (join and collectives) before failing."""
    step_delay_s: float = 0.0
    """Idle seconds per step standing in for compute (toy, sft and rl jobs), so spine tests can signal mid-run."""

    def __post_init__(self):
        check(self.steps >= 1, "steps", "must be >= 1")
        check(self.lr > 0, "lr", "must be > 0")
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.grad_clip >= 0, "grad_clip", "must be >= 0")
        check(0 <= self.warmup_steps < self.steps, "warmup_steps",
              f"must be >= 0 and less than train.steps = {self.steps}")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        check(self.dist_timeout_s > 0, "dist_timeout_s", "must be > 0 (seconds)")
        check(self.step_delay_s >= 0, "step_delay_s", "must be >= 0 (seconds)")

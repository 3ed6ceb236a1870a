"""`train:` in a job YAML: what both entrances (SFT and RL) share on the trainer side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    backend: Literal["torch", "megatron"] = "torch"
    """torch = DDP trainer (CPU default); megatron = Megatron-core (GPU)."""
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

    def __post_init__(self):
        check(self.steps >= 1, "steps", "must be >= 1")
        check(self.lr > 0, "lr", "must be > 0")
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.grad_clip >= 0, "grad_clip", "must be >= 0")

"""Trainer memory per GPU: parameters, gradients, optimizer shards, activations, logits, temporaries.

`memory:` in a job YAML. Bytes per parameter follow Megatron's bf16 default: bf16 weights (2 B), fp32
main gradients (4 B), and 12 B of optimizer state (fp32 master + two Adam moments) sharded by the
distributed optimizer over DP (dense) or the expert-DP group DP/EP (experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    weight_bytes: float = 2.0
    """Bytes per parameter of the resident weights (bf16 = 2)."""
    grad_bytes: float = 4.0
    """Bytes per parameter of the gradient buffer (Megatron keeps fp32 main grads with bf16: 4)."""
    optimizer_bytes: float = 12.0
    """Bytes per parameter of optimizer state (fp32 master 4 + Adam m 4 + v 4)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over DP (dense) and DP/EP (experts), as Megatron's distributed optimizer."""
    recompute: Literal["none", "selective", "full"] = "selective"
    """Activation recomputation: none keeps all, selective drops attention internals, full keeps layer inputs."""
    activation_gb: float | None = None
    """Override: activations + temporaries per GPU in GB, as measured; null = computed from the shape."""
    logits_gb: float | None = None
    """Override: logits + cross-entropy memory in GB (included in activations); null = computed."""
    fused_ce: bool = False
    """A fused cross-entropy kernel that never materialises the full logits (saves logits_gb)."""
    temporaries_gb: float = 2.0
    """Communication buffers and allocator slack when activations are computed, in GB."""
    other_resident_gb: float = 0.0
    """Resident memory not modelled by the parameter terms (CUDA context, NCCL buffers), in GB."""
    tight_headroom_pct: float = 10.0
    """Headroom below this share of GPU memory is `tight`."""
    not_advised_headroom_pct: float = 5.0
    """Headroom below this share is `not advised` (one long sample OOMs); below 0 is `OOM`."""

    def __post_init__(self):
        for name in ("weight_bytes", "grad_bytes", "optimizer_bytes", "temporaries_gb", "other_resident_gb"):
            check(getattr(self, name) >= 0, name, "must be >= 0")
        for name in ("activation_gb", "logits_gb"):
            value = getattr(self, name)
            check(value is None or value >= 0, name, "must be >= 0 (GB)")
        check(0 <= self.not_advised_headroom_pct <= self.tight_headroom_pct < 100, "tight_headroom_pct",
              f"must satisfy 0 <= memory.not_advised_headroom_pct ({self.not_advised_headroom_pct}) "
              f"<= memory.tight_headroom_pct ({self.tight_headroom_pct}) < 100")

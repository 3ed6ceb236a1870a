"""The model's shape, and the parameter counts the planner and the embedded model derive from it.

`model:` in a job YAML. Counts may be given directly (`*_params_b`) where the shape is unknown or where a
user calibrates against measured numbers; otherwise they are computed from the shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "tiny"
    """A label for reports (the embedded default is `tiny`)."""
    layers: int = 2
    """Transformer layers."""
    hidden: int = 64
    """Hidden size (d_model)."""
    heads: int = 4
    """Attention heads."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention; null = heads (plain multi-head attention)."""
    ffn_hidden: int = 256
    """Hidden size of the dense MLP (per expert: `expert_ffn_hidden`)."""
    vocab: int = 32
    """Vocabulary size."""
    max_positions: int = 128
    """Longest sequence the position embedding covers, in tokens."""
    experts: int = 0
    """Routed experts per MoE layer; 0 = a dense model."""
    topk: int = 0
    """Experts each token is routed to (MoE only)."""
    expert_ffn_hidden: int | None = None
    """Hidden size of one expert's MLP; null = ffn_hidden."""
    tie_embeddings: bool = True
    """Input embedding and LM head share one matrix."""
    expert_params_b: float | None = None
    """Override: all routed-expert parameters, in billions (e.g. 35 for the lecture's model)."""
    dense_params_b: float | None = None
    """Override: non-expert parameters each GPU holds before TP/PP sharding, in billions."""
    active_params_b: float | None = None
    """Override: parameters read per decoded token, in billions (the decode roofline uses it)."""

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "max_positions"):
            check(getattr(self, name) > 0, name, "must be > 0")
        check(self.hidden % self.heads == 0, "heads", f"must divide model.hidden = {self.hidden}")
        if self.kv_heads is not None:
            check(self.kv_heads > 0 and self.heads % self.kv_heads == 0, "kv_heads",
                  f"must be > 0 and divide model.heads = {self.heads}")
        check(self.experts >= 0, "experts", "must be >= 0")
        if self.experts:
            check(0 < self.topk <= self.experts, "topk", f"must be in 1..model.experts = {self.experts}")
        for name in ("expert_params_b", "dense_params_b", "active_params_b"):
            value = getattr(self, name)
            check(value is None or value >= 0, name, "must be >= 0 (billions of parameters)")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 or bool(self.expert_params_b)

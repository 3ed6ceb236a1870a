"""The model's shape, and the parameter counts the planner and the embedded model derive from it.

`model:` in a job YAML. Counts may be given directly (`*_params_b`) where the shape is unknown or where a
user calibrates against measured numbers; otherwise they are computed from the shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.configfile import check, check_range, check_text


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "tiny"
    """A label for reports (the embedded default is `tiny`); at most 128 characters."""
    layers: int = 2
    """Transformer layers. Range [1, 1024]."""
    hidden: int = 64
    """Hidden size (d_model). Range [1, 1000000]."""
    heads: int = 4
    """Attention heads. Range [1, 4096]."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention; null = heads (plain multi-head attention). Range [1, 4096]."""
    head_dim: int | None = None
    """Size of one attention head; null = hidden / heads (Qwen3-style models set it larger). Range [1, 65536]."""
    ffn_hidden: int = 256
    """Hidden size of the dense MLP (per expert: `expert_ffn_hidden`). Range [1, 1e7]."""
    vocab: int = 32
    """Vocabulary size. Range [1, 1e7]."""
    max_positions: int = 128
    """Longest sequence the position embedding covers, in tokens. Range [1, 1e8]."""
    experts: int = 0
    """Routed experts per MoE layer; 0 = a dense model. Range [0, 65536]."""
    topk: int = 0
    """Experts each token is routed to (MoE only: 0 with a dense model). Range [0, 1024]."""
    expert_ffn_hidden: int | None = None
    """Hidden size of one expert's MLP; null = ffn_hidden (MoE only). Range [1, 1e7]."""
    tie_embeddings: bool = True
    """Input embedding and LM head share one matrix."""
    expert_params_b: float | None = None
    """Override: all routed-expert parameters, in billions (e.g. 35 for the lecture's model). Range [0, 1000000]."""
    dense_params_b: float | None = None
    """Override: non-expert parameters each GPU holds before TP/PP sharding, in billions. Range (0, 1000000]."""
    active_params_b: float | None = None
    """Override: parameters read per decoded token, in billions (the decode roofline uses it). Range (0, 1000000]."""

    def __post_init__(self):
        check_text(self.name, "name", 128)
        check_range(self.layers, "layers", 1, 1024)
        check_range(self.hidden, "hidden", 1, 1_000_000)
        check_range(self.heads, "heads", 1, 4096)
        check_range(self.kv_heads, "kv_heads", 1, 4096)
        check_range(self.head_dim, "head_dim", 1, 65_536)
        for name in ("ffn_hidden", "vocab", "expert_ffn_hidden"):
            check_range(getattr(self, name), name, 1, 10**7)
        check_range(self.max_positions, "max_positions", 1, 10**8, note="tokens")
        check_range(self.experts, "experts", 0, 65_536)
        check_range(self.topk, "topk", 0, 1024)
        check(self.hidden % self.heads == 0, "heads", f"must divide model.hidden = {self.hidden}")
        if self.kv_heads is not None:
            check(self.kv_heads > 0 and self.heads % self.kv_heads == 0, "kv_heads",
                  f"must be > 0 and divide model.heads = {self.heads}")
        if self.experts:
            check(0 < self.topk <= self.experts, "topk", f"must be in 1..model.experts = {self.experts}")
        check_range(self.expert_params_b, "expert_params_b", 0, 1_000_000, note="billions of parameters")
        for name in ("dense_params_b", "active_params_b"):
            check_range(getattr(self, name), name, 0, 1_000_000, low_open=True, note="billions of parameters")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 or bool(self.expert_params_b)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model: what the shape gives, and what the planner uses (overrides win)."""

    dense: float
    """Non-expert parameters: embeddings, attention, norms, routers, dense MLPs."""
    expert: float
    """All routed-expert parameters (every layer, every expert)."""
    active: float
    """Parameters read per decoded token: dense + topk experts of every layer."""
    shape_dense: float
    shape_expert: float
    shape_active: float
    overridden: tuple[str, ...]
    """Names of the `model.*_params_b` overrides that replaced a shape count."""

    @property
    def total(self) -> float:
        return self.dense + self.expert


def shape_counts(m: ModelConfig) -> tuple[float, float, float]:
    """(dense, expert, active) parameters of the Llama/Qwen-MoE layout the shape describes.

    Llama layout, no biases: q and o are hidden x heads*head_dim, k and v hidden x kv_heads*head_dim,
    a SwiGLU MLP has three matrices (gate, up, down), two RMSNorms per layer and one at the end. An MoE
    layer replaces the MLP with `experts` SwiGLU experts plus a hidden x experts router.
    """
    attention = m.hidden * m.dim_per_head * (2 * m.heads + 2 * m.n_kv_heads)
    norms = 2 * m.hidden
    embeddings = m.vocab * m.hidden * (1 if m.tie_embeddings else 2)
    one_expert = 3 * m.hidden * (m.expert_ffn_hidden or m.ffn_hidden)
    if m.experts:
        dense_layer, expert = attention + norms + m.hidden * m.experts, m.layers * m.experts * one_expert
        active_expert = m.layers * m.topk * one_expert
    else:
        dense_layer, expert, active_expert = attention + norms + 3 * m.hidden * m.ffn_hidden, 0, 0
    dense = m.layers * dense_layer + m.hidden + embeddings
    return float(dense), float(expert), float(dense + active_expert)


def param_counts(m: ModelConfig) -> ParamCounts:
    """Counts from the shape, each replaced by its `model.*_params_b` override where one is set."""
    dense, expert, active = shape_counts(m)
    overridden = tuple(name for name in ("dense_params_b", "expert_params_b", "active_params_b")
                       if getattr(m, name) is not None)

    def pick(override: float | None, computed: float) -> float:
        return computed if override is None else override * 1e9

    use_dense, use_expert = pick(m.dense_params_b, dense), pick(m.expert_params_b, expert)
    if m.active_params_b is not None:
        use_active = m.active_params_b * 1e9
    elif m.expert_params_b is not None or m.dense_params_b is not None:
        # Keep the shape's routed share (topk / experts) of whatever expert count is used.
        share = (m.topk / m.experts) if m.experts else 0.0
        use_active = use_dense + share * use_expert
    else:
        use_active = active
    return ParamCounts(use_dense, use_expert, use_active, dense, expert, active, overridden)

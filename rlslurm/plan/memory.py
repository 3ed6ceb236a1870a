"""Trainer memory per GPU: parameters, gradients, optimizer shards, activations, logits, temporaries.

`memory:` in a job YAML. Bytes per parameter follow Megatron's bf16 default: bf16 weights (2 B), fp32
main gradients (4 B), and 12 B of optimizer state (fp32 master + two Adam moments) sharded by the
distributed optimizer over DP (dense) or the expert-DP group DP/EP (experts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check, check_range
from rlslurm.modelspec import ModelConfig, ParamCounts
from rlslurm.plan.parallel import ParallelConfig
from rlslurm.plan.quantity import Q, gb, params


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    weight_bytes: float = 2.0
    """Bytes per parameter of the resident weights (bf16 = 2). Range [0, 64]."""
    grad_bytes: float = 4.0
    """Bytes per parameter of the gradient buffer (Megatron keeps fp32 main grads with bf16: 4). Range [0, 64]."""
    optimizer_bytes: float = 12.0
    """Bytes per parameter of optimizer state (fp32 master 4 + Adam m 4 + v 4). Range [0, 256]."""
    distributed_optimizer: bool = True
    """Shard optimizer state over DP (dense) and DP/EP (experts), as Megatron's distributed optimizer."""
    recompute: Literal["none", "selective", "full"] = "selective"
    """Activation recomputation: none keeps all, selective drops attention internals, full keeps layer inputs."""
    activation_gb: float | None = None
    """Override: activations + temporaries per GPU in GB, as measured; null = computed from the shape.
    Range [0, 1000000]."""
    logits_gb: float | None = None
    """Override: logits + cross-entropy memory in GB (included in activations); null = computed. Range [0, 1000000]."""
    fused_ce: bool = False
    """A fused cross-entropy kernel that never materialises the full logits (saves logits_gb)."""
    temporaries_gb: float = 2.0
    """Communication buffers and allocator slack when activations are computed, in GB (unused when
    activation_gb is set). Range [0, 1000000]."""
    other_resident_gb: float = 0.0
    """Resident memory not modelled by the parameter terms (CUDA context, NCCL buffers), in GB. Range [0, 1000000]."""
    tight_headroom_pct: float = 10.0
    """Headroom below this share of GPU memory is `tight`. Range [0, 100], below 100 and at least
    not_advised_headroom_pct."""
    not_advised_headroom_pct: float = 5.0
    """Headroom below this share is `not advised` (one long sample OOMs); below 0 is `OOM`. Range [0, 100]."""
    measured_recompute: Literal["none", "selective", "full"] | None = None
    """The recompute mode under which memory.activation_gb and timing.train_step_s were measured; null =
    memory.recompute. When memory.recompute differs, the plan rescales both: the activations by the
    difference of the shape's layer terms, the train step by the recompute cost (rlslurm/plan/recompute.py)."""

    def __post_init__(self):
        for name in ("weight_bytes", "grad_bytes"):
            check_range(getattr(self, name), name, 0, 64, note="bytes per parameter")
        check_range(self.optimizer_bytes, "optimizer_bytes", 0, 256, note="bytes per parameter")
        for name in ("activation_gb", "logits_gb", "temporaries_gb", "other_resident_gb"):
            check_range(getattr(self, name), name, 0, 1_000_000, note="GB")
        for name in ("tight_headroom_pct", "not_advised_headroom_pct"):
            check_range(getattr(self, name), name, 0, 100, note="% of GPU memory")
        check(0 <= self.not_advised_headroom_pct <= self.tight_headroom_pct < 100, "tight_headroom_pct",
              f"must satisfy 0 <= memory.not_advised_headroom_pct ({self.not_advised_headroom_pct}) "
              f"<= memory.tight_headroom_pct ({self.tight_headroom_pct}) < 100")


Verdict = Literal["ok", "tight", "not advised", "OOM"]


def verdict(headroom_pct: float, memory: MemoryConfig) -> Verdict:
    """ok / tight / not advised / OOM from the headroom left under the GPU's memory."""
    if headroom_pct < 0:
        return "OOM"
    if headroom_pct < memory.not_advised_headroom_pct:
        return "not advised"
    if headroom_pct < memory.tight_headroom_pct:
        return "tight"
    return "ok"


@dataclass(frozen=True)
class Activations:
    """Activation memory per GPU of the first pipeline stage (the worst), logits included."""

    layers: Q
    logits: Q
    temporaries: Q
    total: Q
    fused_ce_saving: Q


def layer_activations(model: ModelConfig, parallel: ParallelConfig, recompute: str) -> Q:
    """Activations the transformer layers keep per GPU under one recompute mode (see `activations`)."""
    p, m = parallel, model
    s, b, h, a, t = p.seq_len / p.cp, p.micro_batch_size, m.hidden, m.heads, p.tp
    width = m.topk * (m.expert_ffn_hidden or m.ffn_hidden) if m.experts else m.ffn_hidden
    mlp = 19 * width / (4 * h)
    per_token = {"none": 15 + mlp + 5 * a * s / h, "selective": 15 + mlp, "full": 2.0}[recompute]
    formula = {"none": f"(15 + MLP {mlp:.3g} + 5 a {a} s / h)", "selective": f"(15 + MLP {mlp:.3g})",
               "full": "2"}[recompute]
    layer_bytes = m.layers * s * b * h * per_token / t
    return Q("layer activations", gb(layer_bytes), "GB",
             f"{m.layers} layers x s {s:g} x b {b} x h {h} x {formula} B / TP {t} (recompute {recompute})")


def activations(model: ModelConfig, parallel: ParallelConfig, memory: MemoryConfig) -> Activations:
    """Korthikanti et al. (2022), 'Reducing Activation Recomputation in Large Transformer Models'.

    Per layer, bf16, with sequence parallelism whenever TP > 1 (Megatron's default with TP):
      none:      s b h (34 + 5 a s / h) / t      selective: 34 s b h / t      full: 2 s b h / t
    where 19 of the 34 are the MLP's (for a 4h MLP): scaled here by the MLP width a token passes
    through (ffn_hidden, or topk x expert_ffn_hidden for MoE) over 4h. With 1F1B the first stage keeps
    PP micro-batches of L/PP layers, i.e. L layers' worth, whatever PP is. s is split by CP; b is the
    micro-batch (parallel.micro_batch_size: both trainers put that many sequences through one forward).
    A measured memory.activation_gb taken under memory.measured_recompute moves by the layer terms' difference
    when memory.recompute differs.
    """
    p, m = parallel, model
    s, b, t = p.seq_len / p.cp, p.micro_batch_size, p.tp
    layers = layer_activations(model, parallel, memory.recompute)
    logit_bytes = b * s * m.vocab * 4 * 2 / t
    if memory.logits_gb is not None:
        logits = Q("logits + CE", memory.logits_gb, "GB", "memory.logits_gb (measured)")
    else:
        logits = Q("logits + CE", gb(logit_bytes), "GB",
                   f"b {b} x s {s:g} x vocab {m.vocab} x 4 B (fp32) x 2 (with grad) / TP {t}")
    temps = Q("temporaries", memory.temporaries_gb, "GB", "memory.temporaries_gb")
    measured = memory.measured_recompute or memory.recompute
    if memory.activation_gb is not None and measured != memory.recompute:
        then = layer_activations(model, parallel, measured)
        total = Q("activations + temporaries", memory.activation_gb + layers.value - then.value, "GB",
                  f"memory.activation_gb {memory.activation_gb:g} GB (calibrated at recompute {measured}) + layers "
                  f"at {memory.recompute} {layers.text()} - layers at {measured} {then.text()}")
        temps = dataclasses.replace(temps, how=temps.how + " [shown for comparison: memory.activation_gb holds it]")
    elif memory.activation_gb is not None:
        total = Q("activations + temporaries", memory.activation_gb, "GB",
                  "memory.activation_gb (calibrated; includes logits and temporaries)")
        unused = " [shown for comparison: memory.activation_gb replaces it]"
        layers = dataclasses.replace(layers, how=layers.how + unused)
        temps = dataclasses.replace(temps, how=temps.how + unused)
    else:
        total = Q("activations + temporaries", layers.value + logits.value + temps.value, "GB",
                  f"{layers.text()} layers + {logits.text()} logits + {temps.text()} temporaries")
    saving = logits.value if memory.fused_ce else 0.0
    fused = Q("fused CE saving", saving, "GB",
              f"logits {logits.text()} never materialised (memory.fused_ce)" if memory.fused_ce
              else "memory.fused_ce = false")
    return Activations(layers, logits, temps, total, fused)


@dataclass(frozen=True)
class TrainerMemory:
    """Per-GPU memory of one trainer rank at a given DP: resident state, activations, peak, verdict."""

    dp: int
    expert_dp: float
    weights: Q
    grads: Q
    dense_optimizer: Q
    expert_optimizer: Q
    other: Q
    resident: Q
    activations: Activations
    peak: Q
    headroom_pct: Q
    verdict: Verdict

    @property
    def terms(self) -> list[Q]:
        act = self.activations
        return [self.weights, self.grads, self.dense_optimizer, self.expert_optimizer, self.other,
                self.resident, act.layers, act.logits, act.temporaries, act.total, act.fused_ce_saving,
                self.peak, self.headroom_pct]


def trainer_memory(counts: ParamCounts, model: ModelConfig, parallel: ParallelConfig, memory: MemoryConfig,
                   hbm_gb: float, dp: int) -> TrainerMemory:
    """Per-GPU trainer memory at data-parallel size `dp` (the caller checked the layout's world rules).

    Dense parameters shard over TP x PP, experts over ETP x EP x PP (ETP = TP unless parallel.etp says
    otherwise, as Megatron's default). Weights and the gradient buffer stay whole on every rank; only the
    optimizer state is sharded, by Megatron's distributed optimizer over the groups its DDP reduces
    gradients in: dense over DP x CP (the context-parallel ranks hold the same weights), experts over the
    expert-DP group world / (ETP x EP x PP). Fewer training GPUs -> smaller groups -> more per GPU.
    """
    p = parallel
    world = dp * p.tp * p.pp * p.cp
    dense = counts.dense / (p.tp * p.pp)
    expert = counts.expert / (p.ep * p.expert_tp * p.pp)
    expert_dp = world / (p.expert_tp * p.ep * p.pp)
    dense_dp = dp * p.cp
    dense_group = f"DP {dp}" if p.cp == 1 else f"DP x CP {dp} x {p.cp}"
    shards = f"({params(dense)} dense + {params(expert)} expert) params"
    weights = Q("weights", gb((dense + expert) * memory.weight_bytes), "GB", f"{shards} x {memory.weight_bytes:g} B")
    grads = Q("gradients", gb((dense + expert) * memory.grad_bytes), "GB", f"{shards} x {memory.grad_bytes:g} B")
    ob = memory.optimizer_bytes
    if memory.distributed_optimizer:
        dense_opt = Q("dense optimizer", gb(dense * ob / dense_dp), "GB",
                      f"{params(dense)} params x {ob:g} B / {dense_group}")
        expert_opt = Q("expert optimizer", gb(expert * ob / expert_dp), "GB",
                       f"{params(expert)} params x {ob:g} B / expert-DP {expert_dp:g}")
    else:
        dense_opt = Q("dense optimizer", gb(dense * ob), "GB", f"{params(dense)} params x {ob:g} B (not sharded)")
        expert_opt = Q("expert optimizer", gb(expert * ob), "GB", f"{params(expert)} params x {ob:g} B (not sharded)")
    other = Q("other resident", memory.other_resident_gb, "GB", "memory.other_resident_gb")
    parts = (weights, grads, dense_opt, expert_opt, other)
    resident = Q("resident", sum(q.value for q in parts), "GB", " + ".join(q.text() for q in parts))
    act = activations(model, parallel, memory)
    peak_gb = resident.value + act.total.value - act.fused_ce_saving.value
    peak = Q("peak", peak_gb, "GB",
             f"resident {resident.text()} + activations {act.total.text()} - fused CE {act.fused_ce_saving.text()}")
    headroom = Q("headroom", 100.0 * (hbm_gb - peak_gb) / hbm_gb, "%",
                 f"({hbm_gb:g} GB - peak {peak.text()}) / {hbm_gb:g} GB")
    return TrainerMemory(dp, expert_dp, weights, grads, dense_opt, expert_opt, other, resident, act, peak,
                         headroom, verdict(headroom.value, memory))

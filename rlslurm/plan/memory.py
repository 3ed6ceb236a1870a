"""Trainer memory per GPU: parameters, gradients, optimizer shards, activations, logits, temporaries.

`memory:` in a job YAML. Bytes per parameter follow the trainer that runs (`resolve`): Megatron's bf16
default is bf16 weights (2 B), fp32 main gradients (4 B) and 12 B of optimizer state (fp32 master + two Adam
moments) sharded by the distributed optimizer over DP (dense) or the expert-DP group DP/EP (experts); the
torch trainer keeps fp32 weights and gradients (4 + 4 B), Adam's two moments whole on every rank (8 B) and,
with DDP, a second fp32 copy of the gradients in its buckets. Activations: rlslurm/plan/activations.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check, check_range
from rlslurm.modelspec import ModelConfig, ParamCounts
from rlslurm.plan.activations import Activations, activations
from rlslurm.plan.parallel import ParallelConfig
from rlslurm.plan.quantity import Q, gb, num, params


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    weight_bytes: float | None = None
    """Bytes per parameter of the resident weights; null = what train.backend runs: torch 4 (fp32), megatron 2
    (bf16; 4 = fp32 throughout, as its trainer then runs). Range [0, 64]."""
    grad_bytes: float | None = None
    """Bytes per parameter of the gradient buffer; null = 4 (fp32: torch's grads, Megatron's main grads).
    Range [0, 64]."""
    optimizer_bytes: float | None = None
    """Bytes per parameter of optimizer state; null = Adam's two fp32 moments (8), plus Megatron's fp32 master
    copy with bf16 weights (12). Range [0, 256]."""
    distributed_optimizer: bool | None = None
    """Shard optimizer state over DP (dense) and DP/EP (experts), as Megatron's distributed optimizer; null =
    what train.backend runs: megatron true, torch false (DDP keeps the whole Adam state on every rank)."""
    recompute: Literal["none", "selective", "full"] | None = None
    """Activation recomputation: none keeps all, selective drops attention internals (Megatron only), full keeps
    layer inputs (torch: transformers' gradient checkpointing); null = megatron selective, torch none."""
    activation_gb: float | None = None
    """Override: activations + temporaries per GPU in GB, as measured; null = computed from the shape.
    Range [0, 1000000]."""
    logits_gb: float | None = None
    """Override: logits + cross-entropy memory in GB (included in activations); null = computed. Range [0, 1000000]."""
    fused_ce: bool = False
    """Token log-probs and the SFT loss without the full-vocab logits (rlslurm/logprobs.py, both trainers): the
    plan subtracts the logits and adds the fused path's working set."""
    temporaries_gb: float | None = None
    """Communication buffers and allocator slack when activations are computed, in GB; null = 2 on a GPU
    profile, 0 on the cpu profile (unused when activation_gb is set). Range [0, 1000000]."""
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


def resolve(memory: MemoryConfig, backend: str, profile: str) -> MemoryConfig:
    """`memory` with every null field set to what train.backend runs (field docstrings): the one place the
    trainers' precision, optimizer state, recompute and the profile's temporaries are decided."""
    torch_ = backend == "torch"
    weight = memory.weight_bytes if memory.weight_bytes is not None else (4.0 if torch_ else 2.0)
    return dataclasses.replace(
        memory, weight_bytes=weight,
        grad_bytes=memory.grad_bytes if memory.grad_bytes is not None else 4.0,
        optimizer_bytes=memory.optimizer_bytes if memory.optimizer_bytes is not None else (
            12.0 if weight == 2.0 and not torch_ else 8.0),
        distributed_optimizer=memory.distributed_optimizer if memory.distributed_optimizer is not None else not torch_,
        recompute=memory.recompute or ("none" if torch_ else "selective"),
        temporaries_gb=memory.temporaries_gb if memory.temporaries_gb is not None else (
            0.0 if profile == "cpu" else 2.0))


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
class TrainerMemory:
    """Per-GPU memory of one trainer rank at a given DP: resident state, activations, peak, verdict."""

    dp: int
    expert_dp: float
    weights: Q
    grads: Q
    dense_optimizer: Q
    expert_optimizer: Q
    buckets: Q
    """torch's DDP gradient buckets (a second fp32 copy of the gradients, world > 1)."""
    other: Q
    resident: Q
    activations: Activations
    peak: Q
    headroom_pct: Q
    verdict: Verdict
    peak_activations_gb: float = 0.0
    """The activations (less fused CE's saving) in the peak's moment; peak - this is what stays resident then."""

    @property
    def terms(self) -> list[Q]:
        act = self.activations
        return [self.weights, self.grads, self.dense_optimizer, self.expert_optimizer, self.buckets, self.other,
                self.resident, act.layers, act.around, act.logits, act.temporaries, act.total, act.fused_ce_saving,
                self.peak, self.headroom_pct]


def trainer_memory(counts: ParamCounts, model: ModelConfig, parallel: ParallelConfig, memory: MemoryConfig,
                   hbm_gb: float, dp: int, *, backend: str = "megatron", accumulates: bool = True,
                   act_scale: float | None = None, run: str = "", adapters: float | None = None) -> TrainerMemory:
    """Per-GPU trainer memory at data-parallel size `dp` (the caller checked the layout's world rules);
    `memory` resolved for `backend` (`resolve`); `accumulates`: an optimizer step takes more than one
    micro-batch, so the gradients of the first are held while the next one's activations are.

    The peak is the worst moment. Megatron keeps its gradient buffer all run: resident + activations. The torch
    trainer makes gradients in the backward pass (set to None after each optimizer step): with one micro-batch
    per step its worst moment is either the start of the backward pass (every activation, and the LM head's
    first gradient) or the optimizer step (every gradient, no activation); with more, the first's gradients
    wait beside the next one's activations. `act_scale`: a run's measured / planned activations
    (rlslurm/plan/calibration.py), applied to the computed count (a measured memory.activation_gb wins).
    `adapters`: train.lora's adapter parameters (rlslurm/plan/lora.py): they add to the weights, and they alone
    have gradients, optimizer state and DDP buckets (the frozen base, the LM head included, has none).

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
    if adapters is not None:  # train.lora: the frozen base trains nothing
        lora = f"{params(adapters)} LoRA adapter params"
        weights = Q("weights", weights.value + gb(adapters * memory.weight_bytes), "GB",
                    f"{weights.how} + {lora} x {memory.weight_bytes:g} B")
        grads = Q("gradients", gb(adapters * memory.grad_bytes), "GB", f"{lora} x {memory.grad_bytes:g} B")
        dense_opt = Q("dense optimizer", gb(adapters * ob), "GB", f"{lora} x {ob:g} B (the base is frozen)")
        expert_opt = Q("expert optimizer", 0.0, "GB", "frozen (train.lora)")
    elif memory.distributed_optimizer:
        dense_opt = Q("dense optimizer", gb(dense * ob / dense_dp), "GB",
                      f"{params(dense)} params x {ob:g} B / {dense_group}")
        expert_opt = Q("expert optimizer", gb(expert * ob / expert_dp), "GB",
                       f"{params(expert)} params x {ob:g} B / expert-DP {expert_dp:g}")
    else:
        dense_opt = Q("dense optimizer", gb(dense * ob), "GB", f"{params(dense)} params x {ob:g} B (not sharded)")
        expert_opt = Q("expert optimizer", gb(expert * ob), "GB", f"{params(expert)} params x {ob:g} B (not sharded)")
    torch_ = backend == "torch"
    if torch_ and world > 1:
        trained, what = ((adapters, f"{params(adapters)} LoRA adapter params") if adapters is not None
                         else (dense + expert, shards))
        buckets = Q("DDP buckets", gb(trained * 4), "GB", f"{what} x 4 B (DDP's fp32 gradient buckets)")
    else:
        buckets = Q("DDP buckets", 0.0, "GB", "Megatron's grad buffer is the gradients" if not torch_ else "world 1")
    other = Q("other resident", memory.other_resident_gb, "GB", "memory.other_resident_gb")
    parts = (weights, grads, dense_opt, expert_opt, buckets, other)
    resident = Q("resident", sum(q.value for q in parts), "GB", " + ".join(q.text() for q in parts))
    act = activations(model, parallel, memory, backend)
    if act_scale is not None and memory.activation_gb is None:
        total = act.total
        act = dataclasses.replace(act, total=Q(total.label, total.value * act_scale, "GB",
                                               f"({total.how}) x measured/planned {act_scale:.3g} ({run})"),
                                  fused_ce_saving=dataclasses.replace(act.fused_ce_saving,
                                                                      value=act.fused_ce_saving.value * act_scale))
    acts = act.total.value - act.fused_ce_saving.value
    how = f"activations {act.total.text()} - fused CE {act.fused_ce_saving.text()}"
    if torch_:
        # [vocab, h] gradients: the fused LM head's accumulator beside the activations; at the end of the backward
        # pass a tied embedding's two gradients and their sum (autograd adds them out of place).
        head = gb(model.vocab * model.hidden * memory.grad_bytes / p.tp) if adapters is None else 0.0  # frozen
        fused_head = head if memory.fused_ce else 0.0
        tied = 2 * head if model.tie_embeddings else 0.0
        held = resident.value - (0.0 if accumulates else grads.value)
        backward = held + fused_head + acts
        end = resident.value + tied
        peak_gb = max(backward, end)
        at_peak = acts + fused_head if backward >= end else 0.0
        grads_how = "resident" if accumulates else f"resident - gradients {grads.text()} (made in it)"
        peak = Q("peak", peak_gb, "GB",
                 f"max(backward's start: {grads_how} {num(held)} GB + {how}"
                 f"{f' + fused LM head gradient {num(fused_head)} GB' if fused_head else ''}, backward's end: "
                 f"resident {resident.text()}{f' + tied embedding gradients 2 x {num(head)} GB' if tied else ''})")
    else:
        # Megatron: the LM head's weight gradient comes as a [vocab, h] tensor before it joins the grad buffer
        # (the fused head's accumulator too); a measured memory.activation_gb holds whatever it held.
        head = 0.0
        if memory.activation_gb is None:
            head = gb(model.vocab * model.hidden * memory.grad_bytes / p.tp) * (2 if memory.fused_ce else 1)
        peak_gb = resident.value + acts + head
        at_peak = acts + head
        peak = Q("peak", peak_gb, "GB", f"resident {resident.text()} + {how}"
                                        f"{f' + LM head gradient {num(head)} GB' if head else ''}")
    headroom = Q("headroom", 100.0 * (hbm_gb - peak_gb) / hbm_gb, "%",
                 f"({hbm_gb:g} GB - peak {peak.text()}) / {hbm_gb:g} GB")
    return TrainerMemory(dp, expert_dp, weights, grads, dense_opt, expert_opt, buckets, other, resident, act, peak,
                         headroom, verdict(headroom.value, memory), at_peak)

"""Activation recomputation's price in time: what each `memory.recompute` mode redoes in the backward pass.

Memory is the other side of the trade (rlslurm/plan/memory.py's layer activations: full keeps each
layer's input, selective drops attention's internals, none keeps everything). Here, in forward FLOPs per
token of the model's shape, with a training step = forward (1) + backward (2) = 3 forwards:

    full       redoes every layer's forward before its backward: + layers' forward / (3 x forward),
               about a third of the step (+33 %) when the layers dominate the LM head
    selective  redoes attention's core only (QK^T, softmax, AV: Megatron's `core_attn`), a few %
    none       redoes nothing

The lecture's question 1b ("full -> selective saves 25 % of the compute"): 1 - 1 / (1 + 1/3) = 25 % is
the full mode's cost with nothing but layers; the shape below counts the LM head too, and what
selective still redoes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlslurm.modelspec import ModelConfig
from rlslurm.plan.parallel import ParallelConfig
from rlslurm.plan.quantity import Q, num

if TYPE_CHECKING:
    from rlslurm.plan.memory import MemoryConfig

MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token of the model's shape, in MFLOP, by part (TP, CP and PP split them all alike)."""

    layer_matmuls: Q
    """One layer's projections and MLP (the routed experts a token passes through, for MoE)."""
    core_attention: Q
    """One layer's QK^T and AV over parallel.seq_len keys (no causal saving: Korthikanti et al.'s count)."""
    head: Q
    """The LM head (logits), once per token."""
    total: Q


def forward_flops(model: ModelConfig, parallel: ParallelConfig) -> ForwardFlops:
    """2 FLOPs per multiply-add of every matrix a token meets in the forward pass."""
    m, s = model, parallel.seq_len
    q, kv = m.heads * m.dim_per_head, m.n_kv_heads * m.dim_per_head
    attn = 2 * m.hidden * (q + 2 * kv) + 2 * q * m.hidden
    if m.experts:
        width = m.topk * (m.expert_ffn_hidden or m.ffn_hidden)
        mlp = 3 * 2 * m.hidden * width + 2 * m.hidden * m.experts  # SwiGLU experts + the router
        mlp_how = f"3 x 2 x h {m.hidden} x topk {m.topk} x {m.expert_ffn_hidden or m.ffn_hidden} + router"
    else:
        mlp = 3 * 2 * m.hidden * m.ffn_hidden
        mlp_how = f"3 x 2 x h {m.hidden} x ffn {m.ffn_hidden}"
    matmuls = Q("layer matmuls", (attn + mlp) / 1e6, "MFLOP/token",
                f"attention projections 2 x h {m.hidden} x (q {q} + 2 kv {kv}) + 2 x q {q} x h + MLP {mlp_how}")
    core = Q("core attention", 4 * s * q / 1e6, "MFLOP/token", f"4 x seq {s} x q {q} (QK^T + AV)")
    head = Q("LM head", 2 * m.hidden * m.vocab / 1e6, "MFLOP/token", f"2 x h {m.hidden} x vocab {m.vocab}")
    total = Q("forward", m.layers * (matmuls.value + core.value) + head.value, "MFLOP/token",
              f"{m.layers} layers x ({matmuls.text()} + {core.text()}) + head {head.text()}")
    return ForwardFlops(matmuls, core, head, total)


def recompute_factor(model: ModelConfig, parallel: ParallelConfig, mode: str) -> Q:
    """A training step's time under `mode` relative to the same step without recomputation."""
    f = forward_flops(model, parallel)
    redo = {"none": 0.0, "selective": model.layers * f.core_attention.value,
            "full": model.layers * (f.layer_matmuls.value + f.core_attention.value)}[mode]
    what = {"none": "nothing", "selective": f"{model.layers} layers' core attention",
            "full": f"{model.layers} layers' forward"}[mode]
    return Q(f"recompute {mode}", 1 + redo / (3 * f.total.value), "x",
             f"1 + {what} {num(redo)} / (3 x forward {f.total.text()})")


def recompute_scale(model: ModelConfig, parallel: ParallelConfig, memory: "MemoryConfig") -> Q:
    """What the train step measured under memory.measured_recompute takes under memory.recompute."""
    measured = memory.measured_recompute or memory.recompute
    now, then = (recompute_factor(model, parallel, mode) for mode in (memory.recompute, measured))
    return Q("recompute scale", now.value / then.value, "x",
             f"{now.label} {now.value:.3f} / {then.label} {then.value:.3f} (memory.measured_recompute)")

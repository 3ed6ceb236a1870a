"""Activation memory per GPU, counted as each trainer's code holds it: the layers, around them, the logits.

    acts = activations(model, parallel, memory, backend="torch")   # layers + around + logits (or fused CE)

Two trainers keep different things for their backward pass, so the plan counts each as it runs:

megatron (Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models'): per layer,
  with sequence parallelism whenever TP > 1,
    none: s b h (34 + 5 a s / h) / t      selective: 34 s b h / t      full: 2 s b h / t        (bytes, bf16)
  where 19 of the 34 are the MLP's (for a 4h MLP): scaled by the width a token passes through (ffn_hidden, or
  topk x expert_ffn_hidden for MoE) over 4h; in fp32 (memory.weight_bytes = 4) every term doubles. With 1F1B
  the first pipeline stage keeps PP micro-batches of L/PP layers, i.e. L layers' worth, whatever PP is.
torch (transformers' Llama with SDPA attention, as the torch trainers run it, activations in fp32): what
  autograd saves per token of one layer, read off the model's code and held to the live-tensor meter
  (rlslurm/memory_meter.py) by bench/bench_plan.py and tests/unit/test_plan_measured.py:
    9 h   the layer input, two RMSNorms' pre-weight and output (2 x 3 h), the query after RoPE, attention's
          output and its contiguous copy
    2 kv  keys after RoPE and values (kv = kv_heads x head_dim)
    4 f   the SwiGLU MLP: gate, SiLU(gate), up and their product
  SDPA's CPU and flash kernels keep no [s, s] scores, so no a s^2 term, and selective recompute (which drops
  them) is none. Full recompute (transformers' gradient checkpointing) keeps each layer's input (h) and
  recomputes one layer at a time (counted around the layers).
Around the layers, per token: the embedding's output, the final norm (4 h), one layer's backward temporaries
  (2 h + 2 f), and under full recompute the one layer being recomputed.
Logits: torch's plain path holds 3 fp32 copies of b x (s - 1) x vocab at its worst moment (the log-softmax,
  its incoming gradient and its input's gradient: rlslurm/logprobs.py); Megatron's vocab-parallel cross
  entropy one (fp32 logits turned into their softmax and its gradient in place, / TP; bf16 adds its own
  copies). memory.fused_ce replaces them with the fused path's working set (`fused_working_set`): one chunk's
  logits and their exp, and the hidden states it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlslurm.modelspec import ModelConfig
from rlslurm.plan.parallel import ParallelConfig
from rlslurm.plan.quantity import Q, gb

if TYPE_CHECKING:
    from rlslurm.plan.memory import MemoryConfig

MIN_CHUNK_TOKENS = 32
"""Fewest tokens per chunk of the fused LM head: below this its matmuls get too thin to run at speed."""


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk of the fused path (rlslurm/logprobs.py): as many as make one chunk's logits about the
    size of the hidden states (Liger-Kernel's rule: tokens x hidden / vocab), at least MIN_CHUNK_TOKENS."""
    return max(MIN_CHUNK_TOKENS, -(-tokens * hidden // vocab))


def working_set_bytes(tokens: int, hidden: int, vocab: int) -> int:
    """What the fused path holds beyond the model's activations: one chunk's fp32 logits and their exp."""
    return 2 * 4 * min(tokens, chunk_tokens(tokens, hidden, vocab)) * vocab


@dataclass(frozen=True)
class Activations:
    """Activation memory per GPU of one micro-batch (the first pipeline stage, the worst)."""

    layers: Q
    around: Q
    """The embedding's output, the final norm, one layer's backward temporaries (and recomputed layer)."""
    logits: Q
    """The plain path's logits + cross entropy (what memory.fused_ce saves, less its working set)."""
    temporaries: Q
    total: Q
    fused_ce_saving: Q


def _tokens(parallel: ParallelConfig) -> tuple[float, int]:
    """(s per rank, b): the sequence is split by CP."""
    return parallel.seq_len / parallel.cp, parallel.micro_batch_size


def layer_activations(model: ModelConfig, parallel: ParallelConfig, recompute: str, backend: str = "megatron",
                      act_bytes: float = 2.0) -> Q:
    """Activations the transformer layers keep per GPU under one recompute mode (module docstring)."""
    p, m = parallel, model
    (s, b), t = _tokens(p), p.tp
    if backend == "torch":
        kv = m.n_kv_heads * m.dim_per_head
        # SDPA keeps no attention scores, so selective recompute (Megatron's: drop them) has nothing to drop.
        per_token = m.hidden if recompute == "full" else 9 * m.hidden + 2 * kv + 4 * m.ffn_hidden
        formula = f"h {m.hidden}" if recompute == "full" else f"(9 h {m.hidden} + 2 kv {kv} + 4 f {m.ffn_hidden})"
        return Q("layer activations", gb(m.layers * s * b * per_token * act_bytes), "GB",
                 f"{m.layers} layers x s {s:g} x b {b} x {formula} x {act_bytes:g} B (torch, recompute {recompute})")
    h, a = m.hidden, m.heads
    width = m.topk * (m.expert_ffn_hidden or m.ffn_hidden) if m.experts else m.ffn_hidden
    mlp = 19 * width / (4 * h)
    per_token = {"none": 15 + mlp + 5 * a * s / h, "selective": 15 + mlp, "full": 2.0}[recompute]
    formula = {"none": f"(15 + MLP {mlp:.3g} + 5 a {a} s / h)", "selective": f"(15 + MLP {mlp:.3g})",
               "full": "2"}[recompute]
    scale = act_bytes / 2.0  # Korthikanti's constants are bytes of bf16 activations
    dtype = "" if scale == 1 else f" x {scale:g} (activations of {act_bytes:g} B)"
    layer_bytes = m.layers * s * b * h * per_token * scale / t
    return Q("layer activations", gb(layer_bytes), "GB",
             f"{m.layers} layers x s {s:g} x b {b} x h {h} x {formula} B{dtype} / TP {t} (recompute {recompute})")


def around_layers(model: ModelConfig, parallel: ParallelConfig, recompute: str, backend: str,
                  act_bytes: float) -> Q:
    """Per GPU, outside the layers' saved tensors: see the module docstring (torch; Megatron's are in its 34)."""
    if backend != "torch":
        return Q("around the layers", 0.0, "GB", "Megatron: within the per-layer count")
    m = model
    (s, b) = _tokens(parallel)
    kv = m.n_kv_heads * m.dim_per_head
    per_token = 6 * m.hidden + 2 * m.ffn_hidden
    how = f"(6 h {m.hidden} + 2 f {m.ffn_hidden}"
    if recompute == "full":
        per_token += 9 * m.hidden + 2 * kv + 4 * m.ffn_hidden
        how += f" + one recomputed layer 9 h + 2 kv {kv} + 4 f"
    return Q("around the layers", gb(s * b * per_token * act_bytes), "GB",
             f"s {s:g} x b {b} x {how}) x {act_bytes:g} B (embedding, final norm, backward temporaries)")


def logits_term(model: ModelConfig, parallel: ParallelConfig, backend: str, act_bytes: float = 2.0) -> Q:
    """The plain path's logits and cross entropy per GPU (module docstring)."""
    m = model
    (s, b), t = _tokens(parallel), parallel.tp
    if backend == "torch":
        return Q("logits + CE", gb(3 * b * (s - 1) * m.vocab * 4), "GB",
                 f"3 x b {b} x (s - 1) {s - 1:g} x vocab {m.vocab} x 4 B (fp32 log-softmax, its gradient and its "
                 "input's gradient)")
    # Megatron's vocab-parallel cross entropy turns the fp32 logits into their softmax and its gradient in place;
    # with bf16 activations the bf16 logits and the gradient's bf16 cast come beside them.
    per = 4 if act_bytes >= 4 else 4 + 2 * act_bytes
    return Q("logits + CE", gb(b * s * m.vocab * per / t), "GB",
             f"b {b} x s {s:g} x vocab {m.vocab} x {per:g} B (fp32 softmax and its gradient in place"
             f"{'' if per == 4 else ' + the bf16 logits and gradient'}) / TP {t}")


def fused_working_set(model: ModelConfig, parallel: ParallelConfig, act_bytes: float) -> Q:
    """What memory.fused_ce holds instead of the logits: `working_set_bytes` of one micro-batch, plus the
    hidden states the fused op saves (in the activations' dtype)."""
    (s, b), t = _tokens(parallel), parallel.tp
    tokens, vocab = int(b * s), max(1, model.vocab // t)
    chunk = min(tokens, chunk_tokens(tokens, model.hidden, vocab))
    hidden = tokens * model.hidden * act_bytes
    return Q("fused CE working set", gb(working_set_bytes(tokens, model.hidden, vocab) + hidden), "GB",
             f"2 x chunk {chunk} tokens x vocab/TP {vocab} x 4 B + tokens {tokens} x h {model.hidden} x "
             f"{act_bytes:g} B")


def activations(model: ModelConfig, parallel: ParallelConfig, memory: "MemoryConfig", backend: str) -> Activations:
    """Layers + around + logits + temporaries of one micro-batch (module docstring); a measured
    memory.activation_gb, taken under memory.measured_recompute, moves by the layer terms' difference when
    memory.recompute differs. `memory` is resolved (rlslurm/plan/memory.py `resolve`)."""
    act_bytes = memory.weight_bytes
    layers = layer_activations(model, parallel, memory.recompute, backend, act_bytes)
    around = around_layers(model, parallel, memory.recompute, backend, act_bytes)
    if memory.logits_gb is not None:
        logits = Q("logits + CE", memory.logits_gb, "GB", "memory.logits_gb (measured)")
    else:
        logits = logits_term(model, parallel, backend, act_bytes)
    temps = Q("temporaries", memory.temporaries_gb, "GB", "memory.temporaries_gb")
    measured = memory.measured_recompute or memory.recompute
    if memory.activation_gb is not None and measured != memory.recompute:
        then = layer_activations(model, parallel, measured, backend, act_bytes)
        total = Q("activations + temporaries", memory.activation_gb + layers.value - then.value, "GB",
                  f"memory.activation_gb {memory.activation_gb:g} GB (calibrated at recompute {measured}) + layers "
                  f"at {memory.recompute} {layers.text()} - layers at {measured} {then.text()}")
        temps = Q(temps.label, temps.value, temps.unit, temps.how + " [shown for comparison: memory.activation_gb "
                                                                 "holds it]")
    elif memory.activation_gb is not None:
        total = Q("activations + temporaries", memory.activation_gb, "GB",
                  "memory.activation_gb (calibrated; includes logits and temporaries)")
        unused = " [shown for comparison: memory.activation_gb replaces it]"
        layers = Q(layers.label, layers.value, layers.unit, layers.how + unused)
        temps = Q(temps.label, temps.value, temps.unit, temps.how + unused)
    else:
        parts = (layers, around, logits, temps)
        total = Q("activations + temporaries", sum(q.value for q in parts), "GB",
                  f"{layers.text()} layers + {around.text()} around + {logits.text()} logits + "
                  f"{temps.text()} temporaries")
    if memory.fused_ce:
        working = fused_working_set(model, parallel, act_bytes)
        saving = Q("fused CE saving", max(0.0, logits.value - working.value), "GB",
                   f"logits {logits.text()} never materialised - {working.explain()} (memory.fused_ce)")
    else:
        saving = Q("fused CE saving", 0.0, "GB", "memory.fused_ce = false")
    return Activations(layers, around, logits, temps, total, saving)

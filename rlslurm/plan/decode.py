"""The rollout side: engine weights, KV cache per token and its capacity, and the decode roofline.

Decode is memory-bound: every generated token reads the active parameters once, so one GPU makes at
most HBM bandwidth / (active params x 2 B) tokens per second and sequence stream (the lecture: 3e9
active on H20 -> 667, on H100 -> 558). The KV cache, not compute, bounds how many sequences run at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlslurm.modelspec import ModelConfig, ParamCounts
from rlslurm.plan.hardware import GPU_PROFILES, HardwareConfig
from rlslurm.plan.quantity import Q, gb, params
from rlslurm.rollout.config import RolloutConfig

ROLLOUT_WEIGHT_BYTES = 2.0  # engines serve bf16 weights, whatever the trainer keeps


@dataclass(frozen=True)
class KVCache:
    """KV-cache bytes per token for the whole model and for one GPU of a TP-`tp` engine."""

    per_token: Q
    per_token_per_gpu: Q


def kv_cache(model: ModelConfig, rollout: RolloutConfig) -> KVCache:
    """2 (K and V) x layers x kv_heads x head_dim x kv_bytes per token.

    An engine with TP larger than the KV-head count replicates heads (vLLM does), so each GPU holds
    max(1, kv_heads / TP) heads rather than a fraction of one.
    """
    m, r = model, rollout
    whole = 2 * m.layers * m.n_kv_heads * m.dim_per_head * r.kv_bytes
    heads_per_gpu = max(1.0, m.n_kv_heads / r.tp)
    per_gpu = 2 * m.layers * heads_per_gpu * m.dim_per_head * r.kv_bytes
    return KVCache(
        Q("KV cache per token", whole / 1024, "KiB",
          f"2 x {m.layers} layers x {m.n_kv_heads} kv_heads x {m.dim_per_head} head_dim x {r.kv_bytes:g} B"),
        Q("KV cache per token per GPU", per_gpu / 1024, "KiB",
          f"2 x {m.layers} layers x {heads_per_gpu:g} kv_heads/GPU (TP {r.tp}) x {m.dim_per_head} x {r.kv_bytes:g} B"),
    )


def weights_gb(counts: ParamCounts, override_gb: float | None) -> Q:
    """GB of bf16 weights an engine serves and a weight sync moves (sync.weights_gb overrides)."""
    if override_gb is not None:
        return Q("weights", override_gb, "GB", "sync.weights_gb")
    return Q("weights", gb(counts.total * ROLLOUT_WEIGHT_BYTES), "GB",
             f"{params(counts.total)} params x {ROLLOUT_WEIGHT_BYTES:g} B (bf16)")


@dataclass(frozen=True)
class RolloutCapacity:
    """What the rollout GPUs of one split hold: engines, KV tokens and concurrent sequences."""

    rollout_gpus: int
    engines: int
    weights_per_gpu: Q
    kv_space_per_gpu: Q
    tokens_per_engine: Q
    seqs_per_engine: Q
    seqs_total: Q


def capacity(weights: Q, kv: KVCache, hw: HardwareConfig, rollout: RolloutConfig, rollout_gpus: int,
             overhead_gb: float) -> RolloutCapacity:
    """KV capacity of engines that may use `gpu_memory_utilization` of each GPU for weights + KV + overhead."""
    r = rollout
    per_gpu = Q("engine weights per GPU", weights.value / r.tp, "GB", f"{weights.text()} / rollout.tp {r.tp}")
    budget = hw.gpu_mem_gb * r.gpu_memory_utilization
    space = Q("KV space per GPU", max(0.0, budget - per_gpu.value - overhead_gb), "GB",
              f"{hw.gpu_mem_gb:g} GB x {r.gpu_memory_utilization:g} - weights {per_gpu.text()} "
              f"- overhead {overhead_gb:g} GB")
    tokens = space.value * 1e9 / (kv.per_token_per_gpu.value * 1024)
    tok = Q("KV tokens per engine", tokens, "tokens", f"{space.text()} / {kv.per_token_per_gpu.text()}")
    seqs = Q("sequences per engine", math.floor(tokens / r.max_seq_len), "seqs",
             f"{tok.text()} / rollout.max_seq_len {r.max_seq_len}")
    engines = rollout_gpus // r.tp
    total = Q("concurrent sequences", seqs.value * engines, "seqs", f"{engines} engines x {seqs.text()}")
    return RolloutCapacity(rollout_gpus, engines, per_gpu, space, tok, seqs, total)


def roofline(active_params: float, hbm_tb_s: float, label: str = "decode roofline") -> Q:
    """Upper bound of decoded tokens/s per GPU and stream: HBM bandwidth / (active params x 2 B)."""
    per_token_gb = gb(active_params * ROLLOUT_WEIGHT_BYTES)
    return Q(label, hbm_tb_s * 1000 / per_token_gb if per_token_gb else float("inf"), "tok/s/GPU",
             f"{hbm_tb_s:g} TB/s / ({params(active_params)} active x {ROLLOUT_WEIGHT_BYTES:g} B "
             f"= {per_token_gb:.3g} GB)")


def roofline_by_profile(active_params: float) -> dict[str, Q]:
    """The same bound on every known GPU, so a user sees which card decodes faster (H20 beats H100)."""
    return {name: roofline(active_params, spec["hbm_bandwidth_tb_s"], f"roofline {name}")
            for name, spec in GPU_PROFILES.items() if name != "cpu"}

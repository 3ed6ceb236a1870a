"""Megatron-core's kernel fusions, chosen at model build from what this process can import.

    chosen = choose_fusions(on_gpu=torch.cuda.is_available())   # each disabled one is logged with its reason
    TransformerConfig(..., **flags(chosen))

A fusion switched on whose kernel is missing fails at the first forward that takes its path, not at build:
megatron/core/fusions/fused_softmax.py's `is_kernel_available` imports `scaled_masked_softmax_cuda` for every
bf16/fp16 attention with 16 < keys <= 4096 and shapes divisible by 4 (real prompt lengths), and the
megatron-core wheel ships no such module (Megatron-LM's `megatron/legacy/fused_kernels` or Apex build it).
So each fusion is on only where its kernel imports here, and otherwise off with the import's own error as
the reason. Fusions rlslurm keeps off everywhere say why too.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fusion:
    """One TransformerConfig fusion flag, as chosen."""

    flag: str
    """The TransformerConfig field."""
    on: bool
    reason: str
    """Why it is on or off: what was imported, or the import's error."""


# flag -> (the modules its kernel needs, what builds them)
_KERNELS: dict[str, tuple[tuple[str, ...], str]] = {
    "masked_softmax_fusion": (("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                               "scaled_softmax_cuda"), "Megatron-LM's fused_kernels (not in the megatron-core wheel)"),
    "gradient_accumulation_fusion": (("fused_weight_gradient_mlp_cuda",), "Apex"),
    "apply_rope_fusion": (("transformer_engine.pytorch",), "Transformer Engine (>= 1.4: fused RoPE)"),
}

# Fusions rlslurm leaves off on every device, and why.
_KEPT_OFF: dict[str, str] = {
    "bias_activation_fusion": "compiled by torch.compile (megatron/core/jit.py) at the first step of each shape, "
                              "and a Llama layer has no bias to fuse",
    "bias_dropout_fusion": "compiled by torch.compile (megatron/core/jit.py), and there is no bias and no dropout",
    "persist_layer_norm": "Apex's FusedLayerNorm only; the local spec's RMSNorm is torch's",
}


def _import_error(modules: tuple[str, ...]) -> str | None:
    """The first of `modules` that does not import, as its error; None when all import."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # an extension built for another torch raises OSError/RuntimeError, not only ImportError
            return f"{name} does not import ({type(e).__name__}: {e})"
    return None


def _rope_error() -> str | None:
    """Megatron binds its fused RoPE only from a Transformer Engine that has it (>= 1.4)."""
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is None:
        return "megatron.core's fused_apply_rotary_pos_emb is None (Transformer Engine < 1.4)"
    return None


def choose_fusions(*, on_gpu: bool) -> list[Fusion]:
    """Every fusion flag rlslurm sets, on where its kernel imports (and a GPU runs it), each disabled one
    logged with its reason."""
    chosen = []
    for flag, (modules, builder) in _KERNELS.items():
        if not on_gpu:
            chosen.append(Fusion(flag, False, "a CUDA kernel, and this process has no GPU"))
            continue
        missing = _import_error(modules)
        if flag == "apply_rope_fusion" and missing is None:
            missing = _rope_error()
        chosen.append(Fusion(flag, missing is None,
                             f"{missing}; it comes with {builder}" if missing else f"imports {', '.join(modules)}"))
    chosen += [Fusion(flag, False, reason) for flag, reason in _KEPT_OFF.items()]
    for fusion in chosen:
        if not fusion.on:
            # A kernel missing on a GPU costs speed and must reach the job's log: a trainer rank sets no log
            # level, so only WARNING and above reach its stderr. Without a GPU, or kept off by choice: expected.
            level = logging.WARNING if on_gpu and fusion.flag in _KERNELS else logging.INFO
            log.log(level, "megatron fusion %s off: %s", fusion.flag, fusion.reason)
    return chosen


def flags(chosen: list[Fusion]) -> dict[str, bool]:
    """TransformerConfig keyword arguments of the chosen fusions."""
    return {f.flag: f.on for f in chosen}

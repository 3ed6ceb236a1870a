"""The Megatron-core trainer backend: DDP with the distributed optimizer, activation recompute, and one
optimizer step over micro-batches of token-weighted log-likelihood.

`build_trainer` is what `train.backend = megatron` trains with, in both entrances: the SFT job
(rlslurm/megatron/sft.py) and the RL policy (rlslurm/megatron/policy.py). It builds on model.py (the same
GPTModel the tests check against transformers) and runs Megatron's own DistributedDataParallel,
DistributedOptimizer and pipeline schedule: on the rank's GPU under NCCL, on the CPU under gloo in CI,
every call inside `device.on_device()` (rlslurm/megatron/device.py says which CUDA assumptions of
megatron-core that answers on CPU, and which stay unused).

One loss serves SFT: per-token weights times the token's negative log-likelihood, summed (the loss mask
over the number of answer tokens as weights: their mean). The RL policy runs the same schedule with its own
loss, the torch Policy's clipped objective (rlslurm/rl/objective.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from rlslurm.configfile import check
from rlslurm.megatron.convert import Layout
from rlslurm.megatron.device import on_device
from rlslurm.megatron.model import build_gpt_model
from rlslurm.memory_meter import MemoryMeter
from rlslurm.modelspec import ModelConfig


@dataclass(frozen=True, kw_only=True)
class MegatronTrainConfig:
    distributed_optimizer: bool = True
    """Shard Adam's fp32 master weights and moments over data-parallel ranks (ZeRO-1)."""
    recompute: Literal["none", "selective", "full"] = "selective"
    """Activation recompute: selective = attention core only; full = whole layers (see recompute_layers)."""
    recompute_layers: int = 1
    """With recompute = full: layers per recomputed block (Megatron's uniform method)."""
    bf16: bool = True
    """bf16 parameters and activations with fp32 master weights; false = fp32 throughout."""
    overlap_grad_reduce: bool = True
    """Start reducing a gradient bucket as soon as its backward is done."""

    def __post_init__(self):
        check(self.recompute_layers >= 1, "recompute_layers", "must be >= 1 (layers per recompute block)")


def _recompute_kwargs(cfg: MegatronTrainConfig) -> dict:
    if cfg.recompute == "none":
        return {}
    if cfg.recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": cfg.recompute_layers}


def build_trainer(model: ModelConfig, layout: Layout, cfg: MegatronTrainConfig, lr: float, grad_clip: float, *,
                  weight_decay: float = 0.0, init: Callable[[torch.nn.Module], None] | None = None,
                  **config_overrides):
    """(ddp_model, optimizer) for this rank; `model.init_parallel(layout)` must have run.

    `init(gpt)` runs on the bare GPTModel before it is wrapped: weights loaded there (an HF checkpoint
    through convert.load_hf_into) are what the optimizer copies into its fp32 master weights; loaded
    after, they would be overwritten by the first step. `config_overrides` are further TransformerConfig
    fields (e.g. layernorm_epsilon of the checkpoint being trained).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    # parallel_output: the loss takes `labels`, and vocab-parallel cross entropy wants each TP rank's slice.
    gpt = build_gpt_model(model, layout, dtype, parallel_output=True,
                          **{**_recompute_kwargs(cfg), **config_overrides})
    if init is not None:
        init(gpt)
    config = gpt.config
    with on_device():
        ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
                use_distributed_optimizer=cfg.distributed_optimizer),
            module=gpt,
        )
        # The schedule calls these: grads are reduced over DP (and the tied embedding over PP) here.
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, bf16=cfg.bf16, params_dtype=dtype, clip_grad=grad_clip,
                            weight_decay=weight_decay, use_distributed_optimizer=cfg.distributed_optimizer),
            [ddp],
        )
        # Megatron gives norms and biases wd_mult 0, but only its OptimizerParamScheduler applies wd_mult (each
        # step); the lr is set here without it (train_step), so the multiplier is applied once, now: the same
        # tensors decay as under the torch trainer (rlslurm/train_config.py adamw).
        for group in optimizer.param_groups:
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
    return ddp, optimizer


def _weighted_nll(weights: torch.Tensor, micro_batches: int, per_token_nll: torch.Tensor):
    # Megatron's schedule divides a 2-tuple loss by the number of micro-batches; the weights already make
    # the sum over all of them the step's loss, so that division is undone.
    loss = (per_token_nll.float() * weights.float()).sum()
    return loss * micro_batches, {"loss": loss.detach()}


def causal_mask(seq: int, device) -> torch.Tensor:
    """[1, 1, seq, seq], True = masked out (Megatron's convention): the future of every position. Right
    padding needs no more: a pad token comes after every real one."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]


def token_nll(model, tokens: torch.Tensor, labels: torch.Tensor, *, fused: bool) -> torch.Tensor:
    """[b, s] -log p(labels | tokens) of a GPTModel (or Megatron's DDP around one). Plain: Megatron's own
    vocab-parallel cross entropy over the [s, b, vocab / TP] logits. Fused (memory.fused_ce): the decoder's
    hidden states through rlslurm/logprobs.py's chunked LM head, reduced over the TP group, never holding
    the logits of more than one chunk of tokens."""
    from megatron.core import parallel_state as ps

    from rlslurm.logprobs import token_logprobs as head_logprobs

    seq = tokens.shape[1]
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    mask = causal_mask(seq, tokens.device)
    if not fused:
        return model(tokens, positions, mask, labels=labels)
    gpt = getattr(model, "module", model)
    # GPTModel returns the decoder's output (final norm applied) before its output layer when post_process
    # is off; the layers are built already, so this only skips the logits.
    gpt.post_process = False
    try:
        hidden = model(tokens, positions, mask)  # [s, b, h]
    finally:
        gpt.post_process = True
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else gpt.output_layer.weight
    b = tokens.shape[0]
    flat = hidden.transpose(0, 1).reshape(b * seq, -1)
    logprobs = head_logprobs(flat, weight, labels.reshape(-1), fused=True,
                             group=ps.get_tensor_model_parallel_group())
    return -logprobs.view(b, seq)




def _forward_step(micro_batches: int, fused: bool, data_iterator: Iterator[dict], model):
    batch = next(data_iterator)
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device, non_blocking=True)
    nll = token_nll(model, tokens, batch["labels"].to(device, non_blocking=True), fused=fused)
    return nll, partial(_weighted_nll, batch["weights"].to(device, non_blocking=True), micro_batches)


def train_step(ddp, optimizer, micro_batches: list[dict], lr: float | None = None, *, fused: bool = False,
               meter: MemoryMeter | None = None) -> dict[str, float]:
    """One optimizer step over micro-batches {tokens, labels, weights} of shape [micro_batch, seq], at
    learning rate `lr` (None: as the optimizer has it). The loss is sum(weights x the label's negative
    log-likelihood) over all micro-batches: weights summing to 1 over the step's tokens make it their mean
    (rlslurm/megatron/sft.py); `fused`: through the chunked LM head (`token_nll`); `meter`: the phases'
    memory (rlslurm/memory_meter.py). Returns {loss, grad_norm, updated} of this rank."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    meter = meter or MemoryMeter(torch.device("cpu"), every_steps=0)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    with on_device():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        seq = micro_batches[0]["tokens"].shape[1]
        with meter.measure("forward_backward"):
            losses = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, len(micro_batches), fused),
                data_iterator=iter(micro_batches), model=[ddp], num_microbatches=len(micro_batches), seq_length=seq,
                micro_batch_size=micro_batches[0]["tokens"].shape[0], decoder_seq_length=seq, forward_only=False)
        with meter.measure("optimizer"):
            updated, grad_norm, _ = optimizer.step()
    # Only the last PP stage computes the loss; other stages report nan rather than a made-up number.
    loss = float(torch.stack([d["loss"] for d in losses]).sum()) if losses else float("nan")
    return {"loss": loss, "grad_norm": float(grad_norm or 0.0), "updated": float(bool(updated))}

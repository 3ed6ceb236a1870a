"""Token log-probabilities of a causal LM, with the full-vocab logits (plain) or without them (fused CE).

    lp = token_logprobs(hidden, weight, labels, fused=True)   # [n]: log p(labels[i] | hidden[i]); grads to both
    scorer = CausalLMScorer(hf_model, fused=True)             # what DDP wraps: forward -> [b, s-1] log-probs
    loss = sft_loss(scorer(ids, mask, labels), labels)        # the SFT loss (labels -100 are left out)

Both trainers need the log-probability of each token (RL's ratio, SFT's loss), and the plain way to get it
holds logits of [tokens x vocab] in fp32, a log_softmax copy of them, and both again as gradients in the
backward pass: for a 49k vocabulary and 16k tokens that is 3 GB per copy, the seed's first-day OOM.
`memory.fused_ce: true` runs `_ChunkedLogprobs` instead: the LM head is applied to `chunk` tokens at a
time, only each token's log-sum-exp is kept, and the backward pass recomputes each chunk's logits (one more
LM-head matmul) to form its gradient. What stays is one chunk's logits and their exp (`working_set_bytes`:
about twice the hidden states, not tokens x vocab): the plan counts exactly that (rlslurm/plan/memory.py).
Values and gradients equal the plain path's to float rounding (tests/unit/test_logprobs.py).

Hand-written because no kept library does this on CPU and GPU alike: Liger's and Megatron 0.16's fused
cross-entropy kernels are Triton / CUDA only, and Megatron's `cross_entropy_loss_fusion` fuses the loss's
elementwise work but still materialises the [s, b, vocab / TP] logits. With a tensor-parallel `group` (the
Megatron trainer) `weight` is this rank's vocabulary slice and the softmax is reduced over the group, as
Megatron's vocab-parallel cross entropy does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlslurm.errors import ConfigError

MIN_CHUNK_TOKENS = 32
"""Fewest tokens per chunk: below this the LM-head matmuls get too thin to run at speed."""


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk of the fused path: as many as make one chunk's logits about the size of the hidden
    states themselves (Liger-Kernel's rule: tokens x hidden / vocab), at least MIN_CHUNK_TOKENS."""
    return max(MIN_CHUNK_TOKENS, -(-tokens * hidden // vocab))


def working_set_bytes(tokens: int, hidden: int, vocab: int) -> int:
    """What the fused path holds beyond its inputs: one chunk's fp32 logits and their exp (the plan's term)."""
    return 2 * 4 * min(tokens, chunk_tokens(tokens, hidden, vocab)) * vocab


def plain_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[n] log-probabilities through the full [n, vocab] logits (no tensor parallelism)."""
    logits = F.linear(hidden, weight).float()
    return torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(labels | hidden) over `chunk` tokens at a time; saves hidden, weight and each token's log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, group):
        n = hidden.shape[0]
        start = _vocab_start(weight, group)
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for i in range(0, n, chunk):
            logits = F.linear(hidden[i:i + chunk], weight).float()
            top = logits.max(-1).values
            _reduce(top, group, dist.ReduceOp.MAX)
            total = torch.exp(logits - top[:, None]).sum(-1)
            _reduce(total, group)
            lse[i:i + chunk] = top + torch.log(total)
            out[i:i + chunk] = _pick(logits, labels[i:i + chunk], start, group) - lse[i:i + chunk]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.group, ctx.start = chunk, group, start
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk, group, start = ctx.chunk, ctx.group, ctx.start
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        rows = weight.shape[0]
        for i in range(0, hidden.shape[0], chunk):
            h = hidden[i:i + chunk]
            g_out = grad_out[i:i + chunk].float()
            # d log p(y) / d logits = onehot(y) - softmax: the softmax from the saved log-sum-exp.
            grad = torch.exp_(F.linear(h, weight).float() - lse[i:i + chunk, None]).mul_(-g_out[:, None])
            local = labels[i:i + chunk] - start
            inside = (local >= 0) & (local < rows)
            index = torch.nonzero(inside)[:, 0]
            grad[index, local[index]] += g_out[index]
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[i:i + chunk] = grad @ weight
            if grad_weight is not None:  # in place: a [vocab, h] temporary would cost the weight's size again
                grad_weight.addmm_(grad.t().float(), h.float())
        if grad_hidden is not None and group is not None and dist.get_world_size(group) > 1:
            # Each rank's slice of the vocabulary adds its share of d loss / d hidden (Megatron's
            # ColumnParallelLinear reduces its input's gradient the same way).
            dist.all_reduce(grad_hidden, group=group)
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None


def _vocab_start(weight: torch.Tensor, group) -> int:
    if group is None or dist.get_world_size(group) == 1:
        return 0
    return dist.get_rank(group) * weight.shape[0]


def _reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _pick(logits: torch.Tensor, labels: torch.Tensor, start: int, group) -> torch.Tensor:
    """Each row's logit at its label, from whichever rank's vocabulary slice holds it."""
    local = labels - start
    inside = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * inside
    _reduce(picked, group)
    return picked


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, fused: bool,
                   group=None, chunk: int | None = None) -> torch.Tensor:
    """[n] log p(labels[i] | hidden[i]) under the LM head `weight` ([vocab, h], or this rank's slice of it
    with a tensor-parallel `group`): chunked without full logits when `fused`, else through them."""
    if not fused and (group is None or dist.get_world_size(group) == 1):
        return plain_logprobs(hidden, weight, labels)
    chunk = chunk or chunk_tokens(hidden.shape[0], hidden.shape[1], weight.shape[0])
    return _ChunkedLogprobs.apply(hidden, weight, labels, chunk, group)


class CausalLMScorer(torch.nn.Module):
    """A Hugging Face causal LM as what the trainers differentiate: the log-probability of each next token.
    DDP wraps this module (so its forward is the one DDP sees); `lm` is the HF model itself (weights,
    checkpoints, export). Fused: the base model's last hidden states through `token_logprobs`; plain: the
    model's own logits, as before."""

    def __init__(self, lm: torch.nn.Module, *, fused: bool):
        super().__init__()
        self.lm = lm
        self.fused = fused
        if fused:
            head = lm.get_output_embeddings()
            if not isinstance(head, torch.nn.Linear) or head.bias is not None or _scaled_logits(lm.config):
                raise ConfigError(f"memory.fused_ce = true needs an LM head that is one bias-free linear layer "
                                  f"without logit scaling; {type(lm).__name__}'s is not: set memory.fused_ce = false")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s-1]: column t is log p(target[:, t + 1]) with target = labels (-100 scored as token 0) or input_ids."""
        target = (input_ids if labels is None else labels.clamp(min=0))[:, 1:]
        if not self.fused:
            logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
            return torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                    use_cache=False).last_hidden_state[:, :-1]
        b, s, h = hidden.shape
        weight = self.lm.get_output_embeddings().weight
        return token_logprobs(hidden.reshape(b * s, h), weight, target.reshape(-1), fused=True).view(b, s)


def sft_loss(logprobs: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Negative log-likelihood summed over the tokens whose label is not -100, over `tokens` (default: their
    count, i.e. Hugging Face's causal-LM loss; a micro-batch passes its whole batch's count)."""
    keep = (labels[:, 1:] != -100).to(logprobs.dtype)
    return -(logprobs * keep).sum() / (keep.sum().clamp(min=1.0) if tokens is None else tokens)


def _scaled_logits(config) -> bool:
    """Whether the model scales or caps its logits after the LM head (Gemma 2, Cohere, Granite, ...)."""
    return any(getattr(config, key, None) not in (None, 1.0, 0.0)
               for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"))

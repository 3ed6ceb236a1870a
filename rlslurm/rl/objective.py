"""The GRPO objective both policies train with, on plain tensors: packing, behaviour log-probs, the loss.

    batch = pack(samples, PAD_ID)                       # right-padded; column t scores token t + 1
    behaviour = behaviour_logprobs(batch, old)          # pi_behaviour: the trainer's own, or the engine's (stale)
    loss = grpo_objective(new, behaviour, batch, clip_eps, divisor)   # summed over rows / divisor

rlslurm/rl/policy.py (torch, DDP) and rlslurm/megatron/policy.py (Megatron-core) call the same functions,
so the two backends make the same loss of the same samples however they are split
(tests/integration/test_megatron_policy.py). The objective is GRPO's sequence-level mean: each response
weighs the same whatever its length, so a long wrong answer does not outvote a short right one; summed
per row and divided by the mini-batch's sequence count (the `divisor`, rlslurm/rl/batches.py), the
micro-batches of a mini-batch add up to exactly its mean, whatever their sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlslurm.rl.experience import Sample


@dataclass
class Packed:
    """Samples as tensors, column t scoring token t + 1 (the torch Policy's layout)."""

    tokens: torch.Tensor
    """[n, w-1] input ids."""
    labels: torch.Tensor
    """[n, w-1] the next token of each position."""
    mask: torch.Tensor
    """[n, w-1] 1.0 where the label is a response token."""
    advantages: torch.Tensor
    """[n, 1]."""
    engine_logprobs: torch.Tensor
    """[n, w-1] the engine's log-probabilities at stale samples' response positions, else 0."""
    stale: torch.Tensor
    """[n, 1] 1.0 for a sample older than the trainer (its behaviour policy is the engine's)."""
    lengths: torch.Tensor
    """[n] tokens of each sequence (prompt + response) before the padding."""
    samples: int
    """Real samples (0: one zero-weight row stands in, so the rank still joins the step)."""

    def rows(self, start: int, stop: int) -> "Packed":
        cut = slice(start, stop)
        return Packed(self.tokens[cut], self.labels[cut], self.mask[cut], self.advantages[cut],
                      self.engine_logprobs[cut], self.stale[cut], self.lengths[cut], self.samples)

    def to(self, device) -> "Packed":
        return Packed(*(t.to(device) for t in (self.tokens, self.labels, self.mask, self.advantages,
                                                self.engine_logprobs, self.stale, self.lengths)), self.samples)

    def ids(self) -> torch.Tensor:
        """[n, w] the whole sequences (an HF model's input_ids)."""
        return torch.cat([self.tokens, self.labels[:, -1:]], dim=1)

    def attention(self) -> torch.Tensor:
        """[n, w] 1 over each sequence's tokens, 0 over its padding (an HF model's attention_mask)."""
        width = self.tokens.shape[1] + 1
        return (torch.arange(width, device=self.lengths.device)[None, :] < self.lengths[:, None]).long()


def pack(samples: list[Sample], pad_id: int) -> Packed:
    """Right-padded tensors of `samples`; an empty list gives one zero-weight row."""
    width = max([len(s.prompt_ids) + len(s.response_ids) for s in samples] + [2])
    n = max(len(samples), 1)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    engine = torch.zeros((n, width - 1))
    adv, stale = torch.zeros((n, 1)), torch.zeros((n, 1))
    lengths = torch.full((n,), width, dtype=torch.long)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        lengths[i] = len(seq)
        start = len(s.prompt_ids) - 1  # position t predicts token t + 1
        mask[i, start: len(seq) - 1] = 1.0
        adv[i, 0] = s.advantage
        if s.staleness > 0:
            stale[i, 0] = 1.0
            engine[i, start: start + len(s.engine_logprobs)] = torch.tensor(s.engine_logprobs)
    return Packed(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask, adv, engine, stale, lengths, len(samples))


def behaviour_logprobs(batch: Packed, old: torch.Tensor) -> torch.Tensor:
    """pi_behaviour per position: the trainer's own (`old`) for a fresh sample, the engine's for a stale one."""
    return torch.where(batch.stale.bool() & (batch.mask > 0), batch.engine_logprobs.to(old.dtype), old)


def grpo_objective(new: torch.Tensor, behaviour: torch.Tensor, batch: Packed, clip_eps: float,
                   samples: float) -> torch.Tensor:
    """The clipped surrogate's sequence means, summed over `batch`'s rows and divided by `samples`, negated:
    the micro-batches of one mini-batch add up to -mean over its `samples` sequences (the ratio is
    pi_theta / pi_behaviour; the clip is PPO's trust region)."""
    ratio = torch.exp(new - behaviour)
    adv = batch.advantages
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_seq = batch.mask.sum(1).clamp(min=1.0)
    return -((surrogate * batch.mask).sum(1) / per_seq).sum() / max(samples, 1e-12)


def kl_to_reference(new: torch.Tensor, reference: torch.Tensor, batch: Packed, samples: float) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) (unbiased, >= 0), sequence means summed / `samples`."""
    per_seq = batch.mask.sum(1).clamp(min=1.0)
    k3 = torch.exp(reference - new) - (reference - new) - 1
    return ((k3 * batch.mask).sum(1) / per_seq).sum() / max(samples, 1e-12)


@dataclass
class UpdateStats:
    """The diagnostics of one update, summed over its micro-batches: response tokens, the engine/trainer
    log-prob gap on fresh samples (a sync or masking bug when > 0), how far stale samples' behaviour
    policy is from the trainer's (drift), and how many tokens the clip stopped."""

    tokens: float = 0.0
    clipped: float = 0.0
    drift: float = 0.0
    gap: float = 0.0
    grad_norms: list[float] = field(default_factory=list)

    def observe(self, samples: list[Sample], batch: Packed, old: torch.Tensor, behaviour: torch.Tensor) -> None:
        """Before the first optimizer step: `old` is the trainer's log-probs of `batch` (rows = `samples`)."""
        mask = batch.mask
        self.tokens += float(mask.sum())
        self.drift += float(((old - behaviour).abs() * mask).sum())
        for i, s in enumerate(samples):
            if s.staleness == 0 and s.engine_logprobs:
                start = len(s.prompt_ids) - 1
                trainer = old[i, start: start + len(s.engine_logprobs)].detach().float().cpu()
                self.gap = max(self.gap, float((trainer - torch.tensor(s.engine_logprobs)).abs().max()))

    def clip(self, new: torch.Tensor, behaviour: torch.Tensor, batch: Packed, clip_eps: float) -> None:
        """The tokens of `batch` whose ratio the loss clipped (|ratio - 1| > clip_eps)."""
        with torch.no_grad():
            ratio = torch.exp(new.detach() - behaviour)
            self.clipped += float((((ratio - 1).abs() > clip_eps).float() * batch.mask).sum())

    def result(self) -> dict:
        tokens = max(self.tokens, 1.0)
        return {"tokens": int(self.tokens), "engine_trainer_logprob_gap": self.gap,
                "clip_fraction": self.clipped / tokens, "stale_logprob_drift": self.drift / tokens,
                "grad_norm": sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else 0.0}

"""The GRPO objective both policies train with, on plain tensors: packing, behaviour log-probs, the loss.

    batch = pack(samples, PAD_ID)                       # right-padded; column t scores token t + 1
    behaviour = behaviour_logprobs(batch, old)          # pi_behaviour: the trainer's own, or the engine's (stale)
    objective = Objective.of(job)                       # rl.*: clip bounds, ratio, aggregation, TIS
    divisor = divisors(objective, parts, world)[j]      # mini-batch j's sequences (or tokens) per rank
    loss = objective.loss(new, behaviour, batch, divisor)   # summed over rows (or tokens) / divisor

rlslurm/rl/policy.py (torch, DDP) and rlslurm/megatron/policy.py (Megatron-core) call the same functions,
so the two backends make the same loss of the same samples however they are split
(tests/integration/test_megatron_policy.py, every switch). By default the objective is GRPO's
sequence-level mean: each response weighs the same whatever its length, so a long wrong answer does not
outvote a short right one; summed per row and divided by the mini-batch's sequence count (the `divisor`,
rlslurm/rl/batches.py), the micro-batches of a mini-batch add up to exactly its mean, whatever their sizes.
rl.loss_agg token_mean divides the token sum by the mini-batch's response tokens instead (counted over
every data-parallel rank, one all-reduce per step), seq_sum_norm each response's sum by a constant
(rlslurm/rl/config.py names each switch's paper; tests/unit/test_rl_objectives.py checks each one).
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
    """[n, w-1] the engine's log-probabilities at the response positions (every sample: rl.tis_cap weighs fresh
    ones by them), else 0."""
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
    """Right-padded tensors of `samples`; an empty list gives one zero-weight row. Built as Python lists and made
    tensors once: a few small tensor writes per sample took 6.5 ms for a demo step's 256 (issue 36), these 2."""
    width = max([len(s.prompt_ids) + len(s.response_ids) for s in samples] + [2])
    n = max(len(samples), 1)
    ids = [[pad_id] * width for _ in range(n)]
    mask = [[0.0] * (width - 1) for _ in range(n)]
    engine = [[0.0] * (width - 1) for _ in range(n)]
    adv, stale, lengths = [[0.0] for _ in range(n)], [[0.0] for _ in range(n)], [width] * n
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[i][: len(seq)] = seq
        lengths[i] = len(seq)
        start = len(s.prompt_ids) - 1  # position t predicts token t + 1
        mask[i][start: len(seq) - 1] = [1.0] * len(s.response_ids) if s.response_mask is None else \
            _values(s.response_mask, len(s.response_ids), "response_mask")
        adv[i][0] = float(s.advantage)
        if s.engine_logprobs:  # at most one per response token, from the first
            engine[i][start: start + len(s.engine_logprobs)] = _values(
                s.engine_logprobs, min(len(s.engine_logprobs), len(s.response_ids)), "engine_logprobs")
        if s.staleness > 0:
            stale[i][0] = 1.0
    tokens = torch.tensor(ids, dtype=torch.long)
    return Packed(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.tensor(mask), torch.tensor(adv),
                  torch.tensor(engine), torch.tensor(stale), torch.tensor(lengths, dtype=torch.long), len(samples))


def _values(values: list, count: int, what: str) -> list[float]:
    """`values` as floats, exactly `count` of them: a list slice would take any length and shift the row."""
    if len(values) != count:
        raise ValueError(f"{what}: {len(values)} values for {count} response tokens")
    return [float(x) for x in values]


def behaviour_logprobs(batch: Packed, old: torch.Tensor) -> torch.Tensor:
    """pi_behaviour per position: the trainer's own (`old`) for a fresh sample, the engine's for a stale one."""
    return torch.where(batch.stale.bool() & (batch.mask > 0), batch.engine_logprobs.to(old.dtype), old)


@dataclass(frozen=True)
class Objective:
    """The clipped surrogate as rl: configures it (rlslurm/rl/config.py says each switch's source)."""

    clip_low: float = 0.2
    """The ratio's floor is 1 - clip_low."""
    clip_high: float = 0.2
    """The ratio's ceiling is 1 + clip_high (DAPO's clip-higher: above clip_low)."""
    loss_agg: str = "seq_mean"
    """seq_mean | token_mean | seq_sum_norm (rl.loss_agg)."""
    ratio: str = "token"
    """token | sequence (rl.ratio; sequence = GSPO's length-normalised ratio)."""
    norm_tokens: int = 1
    """seq_sum_norm's constant (rl.loss_norm_tokens, else rollout.max_new_tokens)."""
    tis_cap: float | None = None
    """rl.tis_cap: the most one fresh token's truncated importance weight pi_trainer / pi_engine may be."""

    @classmethod
    def of(cls, job) -> "Objective":
        rl = job.rl
        return cls(clip_low=rl.clip_low, clip_high=rl.clip_high, loss_agg=rl.loss_agg, ratio=rl.ratio,
                   norm_tokens=rl.loss_norm_tokens or job.rollout.max_new_tokens, tis_cap=rl.tis_cap)

    @property
    def per_token(self) -> bool:
        """Whether the divisor counts response tokens (token_mean) rather than sequences."""
        return self.loss_agg == "token_mean"

    def units(self, samples: list[Sample]) -> int:
        """What one mini-batch's divisor counts of `samples`: response tokens (token_mean), else sequences."""
        return sum(len(s.response_ids) for s in samples) if self.per_token else len(samples)

    def log_ratio(self, new: torch.Tensor, behaviour: torch.Tensor, batch: Packed) -> torch.Tensor:
        """log(pi_theta / pi_behaviour) per position; rl.ratio sequence: each row's mean over its response
        tokens, on every position of the row (GSPO's s_i = exp of it)."""
        log_ratio = new - behaviour
        if self.ratio == "sequence":
            mask = batch.mask
            per_seq = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
            log_ratio = per_seq.expand_as(new)
        return log_ratio

    def tis_weights(self, behaviour: torch.Tensor, batch: Packed) -> torch.Tensor | None:
        """min(pi_trainer / pi_engine, tis_cap) per position, no gradient; None with TIS off. A fresh sample's
        behaviour log-probs are the trainer's own, so this is its trainer/engine mismatch; a stale one's are
        the engine's, so its weight is exactly 1 (its ratio already corrects toward the engine's)."""
        if self.tis_cap is None:
            return None
        with torch.no_grad():
            return torch.exp(behaviour - batch.engine_logprobs.to(behaviour.dtype)).clamp(max=self.tis_cap)

    def aggregate(self, terms: torch.Tensor, batch: Packed, divisor: float) -> torch.Tensor:
        """Per-position `terms` (masked here) to this micro-batch's share of the mini-batch's loss."""
        mask = batch.mask
        if self.loss_agg == "token_mean":
            total = (terms * mask).sum()
        elif self.loss_agg == "seq_sum_norm":
            total = ((terms * mask).sum(1) / float(self.norm_tokens)).sum()
        else:
            total = ((terms * mask).sum(1) / mask.sum(1).clamp(min=1.0)).sum()
        return total / max(divisor, 1e-12)

    def loss(self, new: torch.Tensor, behaviour: torch.Tensor, batch: Packed, divisor: float) -> torch.Tensor:
        """The clipped surrogate, aggregated and negated: the micro-batches of one mini-batch add up to
        -(its objective) when `divisor` is the mini-batch's units (sequences, or tokens) per rank."""
        ratio = torch.exp(self.log_ratio(new, behaviour, batch))
        adv = batch.advantages
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - self.clip_low, 1 + self.clip_high) * adv)
        weights = self.tis_weights(behaviour, batch)
        if weights is not None:
            surrogate = surrogate * weights
        return -self.aggregate(surrogate, batch, divisor)

    def clipped(self, new: torch.Tensor, behaviour: torch.Tensor, batch: Packed) -> float:
        """Response tokens whose ratio lies outside [1 - clip_low, 1 + clip_high]."""
        with torch.no_grad():
            ratio = torch.exp(self.log_ratio(new.detach(), behaviour, batch))
            outside = (ratio < 1 - self.clip_low) | (ratio > 1 + self.clip_high)
            return float((outside.float() * batch.mask).sum())


def divisors(objective: Objective, parts: list, world: int, reduce=None, device=None) -> list[float]:
    """Each mini-batch's loss divisor on one of `world` data-parallel ranks (DDP averages their gradients, so
    x world makes it their sum): its sequences over all ranks (known from `part.total` alone), or with
    token_mean its response tokens, summed over the ranks by `reduce` (an in-place all-reduce; None: one
    rank) on `device` (NCCL reduces GPU tensors only). Every rank must call it: `reduce` is collective."""
    if not objective.per_token:
        return [part.total / world for part in parts]
    local = torch.tensor([float(objective.units(part.samples)) for part in parts], dtype=torch.float64,
                         device=device)
    if reduce is not None:
        reduce(local)
    return [float(x) / world for x in local.tolist()]


def grpo_objective(new: torch.Tensor, behaviour: torch.Tensor, batch: Packed, clip_eps: float,
                   samples: float) -> torch.Tensor:
    """Plain GRPO (symmetric clip, sequence mean): `Objective(clip_eps, clip_eps).loss(...)`."""
    return Objective(clip_low=clip_eps, clip_high=clip_eps).loss(new, behaviour, batch, samples)


def kl_to_reference(new: torch.Tensor, reference: torch.Tensor, batch: Packed, samples: float,
                    objective: Objective | None = None) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) (unbiased, >= 0), aggregated as `objective`'s loss
    (default: sequence means summed / `samples`)."""
    k3 = torch.exp(reference - new) - (reference - new) - 1
    return (objective or Objective()).aggregate(k3, batch, samples)


@dataclass
class UpdateStats:
    """The diagnostics of one update, summed over its micro-batches: response tokens, the engine/trainer
    log-prob gap on fresh samples (a sync or masking bug when large), its mean per token (the mismatch TIS
    corrects), how far stale samples' behaviour policy is from the trainer's (drift), how many tokens the clip
    stopped, and with rl.tis_cap the truncated importance weights."""

    tokens: float = 0.0
    clipped: float = 0.0
    drift: float = 0.0
    gap: float = 0.0
    fresh_tokens: float = 0.0
    mismatch: float = 0.0
    tis_weight: float = 0.0
    tis_capped: float = 0.0
    grad_norms: list[float] = field(default_factory=list)

    def observe(self, samples: list[Sample], batch: Packed, old: torch.Tensor, behaviour: torch.Tensor,
                objective: Objective | None = None) -> None:
        """Before the first optimizer step: `old` is the trainer's log-probs of `batch` (rows = `samples`)."""
        mask = batch.mask
        self.tokens += float(mask.sum())
        self.drift += float(((old - behaviour).abs() * mask).sum())
        # The fresh samples' engine log-probs against the trainer's at the same positions, all rows in a few tensor
        # ops (one small tensor per sample cost ~5 % of an update of the demo's 256 samples a rank).
        rows = [i for i, s in enumerate(samples) if s.staleness == 0 and s.engine_logprobs]
        if rows:
            engine = [samples[i].engine_logprobs for i in rows]
            width = max(len(e) for e in engine)
            padded = torch.tensor([e + [0.0] * (width - len(e)) for e in engine])
            valid = torch.arange(width)[None, :] < torch.tensor([len(e) for e in engine])[:, None]
            starts = torch.tensor([len(samples[i].prompt_ids) - 1 for i in rows])
            cols = (starts[:, None] + torch.arange(width)[None, :]).clamp(max=old.shape[1] - 1)
            # only the model's own tokens: a multi-turn episode's tool results are masked out (no engine log-prob)
            valid &= mask.detach().cpu()[torch.tensor(rows)[:, None], cols] > 0
            trainer = old.detach().float().cpu()[torch.tensor(rows)[:, None], cols]
            diff = torch.where(valid, (trainer - padded).abs(), 0.0)
            self.gap = max(self.gap, float(diff.max()))
            self.fresh_tokens += float(valid.sum())
            self.mismatch += float(diff.sum())
        weights = objective.tis_weights(behaviour, batch) if objective is not None else None
        if weights is not None:
            fresh = mask * (1.0 - batch.stale)
            self.tis_weight += float((weights * fresh).sum())
            self.tis_capped += float(((weights >= objective.tis_cap).float() * fresh).sum())

    def clip(self, new: torch.Tensor, behaviour: torch.Tensor, batch: Packed,
             objective: Objective | float) -> None:
        """The tokens of `batch` whose ratio the loss clipped (outside [1 - clip_low, 1 + clip_high]); a float
        is a symmetric clip_eps."""
        if not isinstance(objective, Objective):
            objective = Objective(clip_low=objective, clip_high=objective)
        self.clipped += objective.clipped(new, behaviour, batch)

    def result(self, *, loss: float = 0.0, kl: float = 0.0) -> dict:
        """The trainer's keys of an RL step's metrics row (docs/metrics.md), one set whether or not the step
        trained, so no reader of metrics.jsonl meets a key that comes and goes. A step with no trainable
        sample (every group zero-variance: these stats untouched, `loss` and `kl` 0) says `trained: false`
        and gives each key its value over no token and no optimizer step: 0; the TIS keys are null where no
        token was weighted (rl.tis_cap unset, or nothing trained)."""
        steps = len(self.grad_norms)
        tokens, fresh = max(self.tokens, 1.0), max(self.fresh_tokens, 1.0)
        return {"trained": steps > 0, "loss": loss, "kl": kl, "mini_batches": steps, "tokens": int(self.tokens),
                "engine_trainer_logprob_gap": self.gap, "engine_trainer_logprob_mismatch": self.mismatch / fresh,
                "clip_fraction": self.clipped / tokens, "stale_logprob_drift": self.drift / tokens,
                "grad_norm": sum(self.grad_norms) / steps if steps else 0.0,
                "tis_weight_mean": self.tis_weight / fresh if self.tis_weight else None,
                "tis_capped_fraction": self.tis_capped / fresh if self.tis_weight else None}

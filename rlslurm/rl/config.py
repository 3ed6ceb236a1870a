"""`rl:` in a job YAML: the GRPO algorithm and the switches of its family (DAPO, Dr. GRPO, GSPO, RLOO, TIS).

Every switch's default is plain GRPO as this project trained it before the switches existed; each field
names the paper it comes from, and tests/unit/test_rl_objectives.py holds it to that paper's formula (and
to TRL's GRPO loss where TRL has it). How they combine, and what `rlslurm validate` refuses: `job_rules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check, check_range


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    prompts_per_step: int = 16
    """Prompts sampled per RL step. Range [1, 100000]."""
    samples_per_prompt: int = 8
    """Responses generated per prompt (the GRPO group size k). Range [2, 4096]."""
    clip_eps: float = 0.2
    """PPO-style clipping of the importance ratio to [1 - clip_eps, 1 + clip_eps]; both bounds unless
    rl.clip_eps_low / rl.clip_eps_high set one of them. Range (0, 1)."""
    clip_eps_low: float | None = None
    """The lower clip bound, ratio >= 1 - clip_eps_low; null = rl.clip_eps. DAPO's clip-higher (Yu et al.
    2025, arXiv:2503.14476, sec. 3.1) keeps 0.2 here and raises only the upper bound. Range (0, 1)."""
    clip_eps_high: float | None = None
    """The upper clip bound, ratio <= 1 + clip_eps_high; null = rl.clip_eps. DAPO's clip-higher: 0.28, so a
    low-probability token with a positive advantage can still rise (against entropy collapse). Range (0, 10]."""
    loss_agg: Literal["seq_mean", "token_mean", "seq_sum_norm"] = "seq_mean"
    """How per-token terms become the loss. seq_mean (GRPO, Shao et al. 2024, arXiv:2402.03300 eq. 3):
    the mean over each response's tokens, then over the responses; token_mean (DAPO sec. 3.3): the mean over
    every response token of the mini-batch, so a long response weighs by its length; seq_sum_norm (Dr. GRPO,
    Liu et al. 2025, arXiv:2503.20783 sec. 3.1): each response's token sum divided by one constant
    (rl.loss_norm_tokens), then the mean over responses: no length bias either way."""
    loss_norm_tokens: int | None = None
    """Dr. GRPO's constant normaliser of rl.loss_agg seq_sum_norm, in tokens; null = rollout.max_new_tokens (the
    longest a response can be, as Dr. GRPO's code and TRL's dr_grpo use). Range [1, 1e7]."""
    ratio: Literal["token", "sequence"] = "token"
    """The importance ratio pi_theta / pi_behaviour. token (PPO, GRPO): per token; sequence (GSPO, Zheng et
    al. 2025, arXiv:2507.18071 eq. 7): per response, (pi_theta(y) / pi_behaviour(y)) ** (1 / |y|) = exp(the
    mean token log-ratio), clipped per response. GSPO's clip range is far narrower (3e-4 / 4e-4 in its paper)."""
    baseline: Literal["group_std", "group_mean", "loo"] = "group_std"
    """The advantage of a response from its group's rewards. group_std (GRPO): (r - mean) / std; group_mean
    (Dr. GRPO sec. 3.1): r - mean, no division by the std (which favours too easy and too hard prompts);
    loo (RLOO, Ahmadian et al. 2024, arXiv:2402.14740 eq. 5): r - the mean of the group's other k - 1 rewards."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (sec. 3.2): a group whose rewards are all equal teaches nothing (it is always left
    out), and with this on, more prompts are drawn, in rounds, until the step holds rl.prompts_per_step groups
    that do teach (surplus groups of the last round are dropped); at most rl.dynamic_sampling_max_rounds rounds,
    then the step trains on what it has. Metrics: ds_rounds, ds_prompts_drawn, ds_surplus_groups,
    ds_short_groups. Every row drawn counts in the data position a checkpoint saves."""
    dynamic_sampling_max_rounds: int = 4
    """Rounds of prompts one step may draw with rl.dynamic_sampling (the first included; verl's
    max_num_gen_batches). Each round is a rollout and its rewards, one after the other. Range [1, 100]."""
    overlong: Literal["none", "filter", "penalty"] = "none"
    """Responses cut by rollout.max_new_tokens (finish_reason length), DAPO sec. 3.4. none: trained on as
    any other; filter (overlong filtering): their reward still counts in their group's baseline, but they are
    left out of the loss; penalty (soft overlong punishment, DAPO eq. 13): every response of more than
    max_new_tokens - rl.overlong_buffer_tokens tokens loses rl.overlong_penalty x (the excess / the buffer)
    of its reward, linearly to -rl.overlong_penalty at max_new_tokens, before the advantages."""
    overlong_buffer_tokens: int | None = None
    """DAPO's L_cache: the last tokens before rollout.max_new_tokens over which rl.overlong penalty grows; required
    with it, below rollout.max_new_tokens. Range [1, 1e7]."""
    overlong_penalty: float = 1.0
    """The most rl.overlong penalty takes off a reward (at rollout.max_new_tokens; verl's penalty_factor).
    Range (0, 100]."""
    tis_cap: float | None = None
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): each token's loss term of a fresh sample is weighed by min(pi_trainer /
    pi_engine, tis_cap), both the log-probs of the weights that sampled it, the trainer's and the engine's
    (they differ by kernels and precision, bf16 vLLM against the trainer); the mismatch is recorded every
    step (tis_weight_mean, tis_capped_fraction, engine_trainer_logprob_mismatch). null = off. Range [1, 1000]."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; 0 = no reference model. Range [0, 100]."""
    max_staleness: int = 1
    """Policy versions a sample may lag behind the trainer (k): step n + k's rollout and reward run on policy
    n while step n trains (rlslurm/rl/pipeline.py, docs/rl-overlap.md); 0 = synchronous. Range [0, 100]."""
    eval_every: int = 5
    """Steps between two greedy held-out evaluations of the served policy (also at the start and the end).
    Range [1, 1e8]."""
    eval_rows: int = 1000
    """Held-out rows each evaluation decodes greedily and scores (the first ones of data.eval, or of the task's
    held-out split): a bound on its time however large the split. Range [1, 1000000]."""
    mini_batches: int = 1
    """Optimizer steps per RL step: the step's samples are cut into this many mini-batches, each one clipped
    update; the behaviour log-probs are taken once, before the first (verl's ppo_mini_batch_size = the step's
    samples / mini_batches; OpenRLHF's train_batch_size). Each mini-batch runs in forward passes of
    parallel.micro_batch_size sequences per rank. Range [1, 1024]."""

    def __post_init__(self):
        check_range(self.prompts_per_step, "prompts_per_step", 1, 100_000)
        check_range(self.samples_per_prompt, "samples_per_prompt", 2, 4096,
                    note="GRPO normalises rewards within a group")
        check(0 < self.clip_eps < 1, "clip_eps", "must be in (0, 1)")
        if self.clip_eps_low is not None:
            check(0 < self.clip_eps_low < 1, "clip_eps_low", "must be in (0, 1) (the ratio's floor is 1 - it)")
        if self.clip_eps_high is not None:
            check_range(self.clip_eps_high, "clip_eps_high", 0, 10, low_open=True)
        check_range(self.loss_norm_tokens, "loss_norm_tokens", 1, 10**7, note="tokens")
        check_range(self.dynamic_sampling_max_rounds, "dynamic_sampling_max_rounds", 1, 100, note="rounds")
        check_range(self.overlong_buffer_tokens, "overlong_buffer_tokens", 1, 10**7, note="tokens")
        check_range(self.overlong_penalty, "overlong_penalty", 0, 100, low_open=True)
        check_range(self.tis_cap, "tis_cap", 1, 1000)
        check_range(self.kl_coef, "kl_coef", 0, 100)
        check_range(self.max_staleness, "max_staleness", 0, 100, note="policy versions")
        check_range(self.eval_every, "eval_every", 1, 10**8, note="steps")
        check_range(self.eval_rows, "eval_rows", 1, 1_000_000, note="rows")
        check_range(self.mini_batches, "mini_batches", 1, 1024, note="optimizer steps per RL step")

    @property
    def clip_low(self) -> float:
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def job_rules(job) -> list[tuple[str, str]]:
    """(key, message) for each combination of rl: switches (and the keys they read elsewhere) that cannot mean
    what it says; each message starts with the key and names the other (rlslurm/config_rules.py's style)."""
    rl, max_new = job.rl, job.rollout.max_new_tokens
    rules = []
    if rl.ratio == "sequence" and rl.loss_agg != "seq_mean":
        rules.append(("rl.ratio", f"rl.ratio = 'sequence' with rl.loss_agg = {rl.loss_agg!r}: GSPO's objective is a "
                                  "mean over responses of one clipped term each; a token sum or token mean weighs "
                                  "each response by its length again (what the sequence ratio removes): set "
                                  "rl.loss_agg: seq_mean, or rl.ratio: token"))
    if rl.overlong == "penalty":
        if rl.overlong_buffer_tokens is None:
            rules.append(("rl.overlong_buffer_tokens", "rl.overlong_buffer_tokens is required with rl.overlong = "
                                                       f"'penalty' (DAPO's L_cache: the last tokens before "
                                                       f"rollout.max_new_tokens = {max_new} over which the penalty "
                                                       "grows), e.g. a fifth of it"))
        elif rl.overlong_buffer_tokens >= max_new:
            rules.append(("rl.overlong_buffer_tokens", f"rl.overlong_buffer_tokens = {rl.overlong_buffer_tokens} "
                                                       f"must be below rollout.max_new_tokens = {max_new}: the "
                                                       "penalty starts that many tokens before the cut"))
    elif rl.overlong_buffer_tokens is not None or rl.overlong_penalty != 1.0:
        key = "rl.overlong_buffer_tokens" if rl.overlong_buffer_tokens is not None else "rl.overlong_penalty"
        rules.append((key, f"{key} is ignored with rl.overlong = {rl.overlong!r} (only the soft penalty reads it): "
                           "set rl.overlong: penalty, or remove it"))
    if rl.loss_norm_tokens is not None:
        if rl.loss_agg != "seq_sum_norm":
            rules.append(("rl.loss_norm_tokens", f"rl.loss_norm_tokens is ignored with rl.loss_agg = {rl.loss_agg!r} "
                                                 "(only Dr. GRPO's seq_sum_norm divides by a constant): remove it"))
        elif rl.loss_norm_tokens < max_new:
            rules.append(("rl.loss_norm_tokens", f"rl.loss_norm_tokens = {rl.loss_norm_tokens} is below "
                                                 f"rollout.max_new_tokens = {max_new}: Dr. GRPO divides by the "
                                                 "longest a response can be, so no response's tokens weigh more "
                                                 "than a full one's; raise it or leave it null"))
    if rl.clip_eps_low is not None and rl.clip_eps_high is not None and rl.clip_eps != 0.2:
        rules.append(("rl.clip_eps", "rl.clip_eps is ignored with both rl.clip_eps_low and rl.clip_eps_high set: "
                                     "remove it"))
    if not rl.dynamic_sampling and rl.dynamic_sampling_max_rounds != 4:
        rules.append(("rl.dynamic_sampling_max_rounds", "rl.dynamic_sampling_max_rounds is ignored with "
                                                        "rl.dynamic_sampling = false: set it true, or remove it"))
    if rl.tis_cap is not None and rl.max_staleness > 0:
        rules.append(("rl.tis_cap", f"rl.tis_cap = {rl.tis_cap:g} does nothing with rl.max_staleness = "
                                    f"{rl.max_staleness}: every step after the first {rl.max_staleness} trains on "
                                    "stale samples, whose ratio is already taken against the engine's own "
                                    "log-probs (what TIS corrects toward); set rl.max_staleness: 0, or remove it"))
    return rules


def behaviour_forward(mini_batches: int) -> bool:
    """Whether an RL update takes the trainer's behaviour log-probs in a no-grad forward before its first optimizer
    step: only with rl.mini_batches > 1. With one mini-batch every forward runs on the weights the samples were
    scored against (no step has been taken yet), so the trainer's own log-probs are the training forward's, detached:
    the ratio of a fresh sample is exactly 1 (TRL's `old_per_token_logps = per_token_logps.detach()`), a stale one's
    is against the engine's log-probs as always, and the engine/trainer gap and the drift are read from it too."""
    return mini_batches > 1

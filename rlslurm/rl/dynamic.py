"""One step's rounds of prompts: one, or, with DAPO's dynamic sampling (rl.dynamic_sampling), more until the step
holds rl.prompts_per_step groups that teach; and the rounds merged into the step's samples and metrics.

    rounds = fill(first, per_step=64, max_rounds=4, next_round=lambda i, n: ..., guard=guard)
    samples, stats = merge(rounds, per_step=64, dynamic=True)

A group whose rewards are all equal has advantage 0 under every baseline and is always left out of the loss
(rlslurm/rl/experience.py); without dynamic sampling the step then trains on fewer groups. With it (DAPO,
Yu et al. 2025, sec. 3.2), each round's rewards are awaited and, while fewer than per_step groups teach and
fewer than max_rounds rounds ran, another round of prompts is drawn (rlslurm/rl/draw.py's `draw_more`: from
where the step's rows end, so the data position stays exact) and rolled out. The next round asks for the
missing groups divided by the share of prompts that taught so far (at most per_step prompts), so a step
usually needs one extra round; the surplus groups of the last round are dropped, as in DAPO's and verl's
recipe, and the rows they came from count as drawn. Every round runs inside the step's rollout (the
pipeline's schedule: a rollout never straddles a weight sync, rlslurm/rl/pipeline.py), so with dynamic
sampling the reward of each round but the last is waited for there, not overlapped.

Metrics of the step: ds_rounds, ds_prompts_drawn, ds_groups (groups trained on), ds_surplus_groups (left out
past per_step), ds_short_groups (missing when max_rounds ran out: the step is not full),
zero_variance_groups (over every round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from rlslurm.rl.draw import StepPrompts
from rlslurm.rl.experience import GroupAssembler, Sample

NO_REWARD_STATS = {"reward_degraded": 0, "reward_degraded_ratio": 0.0, "reward_dropped": 0, "reward_restarts": 0}
"""A round scored inline (reward.service inline): nothing degraded, dropped or restarted."""


@dataclass
class Round:
    """One draw of prompts through the engines: the prompts, their responses as they arrived, the rewards."""

    drawn: StepPrompts
    assembler: GroupAssembler
    scoring: object | None
    """The reward service's StepScoring of this round (None: scored inline as the responses arrived)."""
    choices: list[dict] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)
    resent: int = 0
    reward_stats: dict | None = None
    """Set by `finish`: the reward service's stats of this round."""
    span_s: float = 0.0
    """Seconds from the round's first engine request to its last answer."""

    def finish(self, guard=None) -> None:
        """Wait for the rewards still open (bounded by the reward client, beating `guard`); idempotent."""
        if self.reward_stats is not None:
            return
        stats = dict(NO_REWARD_STATS)
        if self.scoring is not None:
            outcomes, stats = self.scoring.finish(guard)
            self.assembler.add_rewards({o.id: o.score for o in outcomes})  # any a callback has not handed over
        self.reward_stats = stats

    def teaching_groups(self) -> int:
        """Groups of this round with a sample to train on (after `finish`)."""
        return sum(group is not None for group in self.assembler.groups())


def next_round_size(per_step: int, teaching: int, drawn: int) -> int:
    """Prompts the next round asks for: the groups still missing over the share of prompts that taught so far
    (per_step while none did), at most per_step."""
    missing = per_step - teaching
    if teaching <= 0:
        return per_step
    return max(1, min(per_step, math.ceil(missing * drawn / teaching)))


def fill(first: Round, *, per_step: int, max_rounds: int, next_round: Callable[[int, int], Round],
         guard=None) -> list[Round]:
    """Rounds until per_step groups teach or max_rounds ran: `next_round(index, prompts)` draws and rolls one out."""
    rounds = [first]
    while True:
        rounds[-1].finish(guard)
        teaching = sum(r.teaching_groups() for r in rounds)
        if teaching >= per_step or len(rounds) >= max_rounds:
            return rounds
        drawn = sum(len(r.drawn.samples) + r.drawn.bad for r in rounds)
        rounds.append(next_round(len(rounds), next_round_size(per_step, teaching, drawn)))


def merge(rounds: list[Round], *, per_step: int, dynamic: bool) -> tuple[list[Sample], dict[int, int], dict]:
    """The step's samples (each round's groups in prompt order; with `dynamic`, the first per_step groups that
    teach), its responses per policy version (every round's, dropped groups too: staleness counts them) and
    its stats: responses, rewards, groups dropped, reward service stats summed, ds_* (dynamic sampling)."""
    samples, taken, surplus, dropped = [], 0, 0, 0
    for r in rounds:
        for group in r.assembler.groups():
            if group is None:
                dropped += 1
            elif dynamic and taken >= per_step:
                surplus += 1
            else:
                samples.extend(group)
                taken += 1
    responses = sum(len(r.choices) for r in rounds)
    reward = {key: sum((r.reward_stats or NO_REWARD_STATS)[key] for r in rounds)
              for key in ("reward_degraded", "reward_dropped", "reward_restarts")}
    reward["reward_degraded_ratio"] = reward["reward_degraded"] / responses if responses else 0.0
    if len(rounds) == 1:  # as the reward service counted it
        reward = dict(rounds[0].reward_stats or NO_REWARD_STATS)
    choices = [c for r in rounds for c in r.choices]
    versions: dict[int, int] = {}
    for c in choices:
        versions[int(c["policy_version"])] = versions.get(int(c["policy_version"]), 0) + 1
    scored = [x for r in rounds for x in r.assembler.rewards() if x is not None]
    engine_s = [sum(s) for s in zip(*(r.engine_s for r in rounds))]
    stats = {"rollout_engine_s": engine_s, "rollout_requests_span_s": sum(r.span_s for r in rounds),
             "reward_mean": sum(scored) / max(len(scored), 1),
             "samples": len(choices), "effective_samples": len(samples), "zero_variance_groups": dropped,
             # the model's tokens, not a multi-turn episode's tool results (rlslurm/rl/episodes.py)
             "generated_tokens": sum(c.get("generated_tokens", len(c["token_ids"])) for c in choices),
             "overlong_responses": sum(c.get("finish_reason") == "length" for c in choices), **reward,
             "prompts_resent": sum(r.resent for r in rounds),
             "data_rows_drawn": sum(len(r.drawn.samples) + r.drawn.bad for r in rounds)}
    if dynamic:
        stats.update(ds_rounds=len(rounds), ds_prompts_drawn=sum(len(r.drawn.samples) for r in rounds),
                     ds_groups=taken, ds_surplus_groups=surplus, ds_short_groups=max(per_step - taken, 0))
    return samples, versions, stats


def drawn_of(rounds: list[Round]) -> StepPrompts:
    """The step's prompts over all its rounds: the first round's position, every row, every bad row."""
    first = rounds[0].drawn
    out = StepPrompts([], first.position, bad=sum(r.drawn.bad for r in rounds),
                      first_reason=next((r.drawn.first_reason for r in rounds if r.drawn.first_reason), None))
    for r in rounds:
        out.samples += r.drawn.samples
        out.rows += r.drawn.rows
    return out

"""GRPO experience: samples, group advantages, and the assembler that builds them as rewards stream in.

    assembler = GroupAssembler(samples, k=8, encode=fmt.encode)   # the ids of the text the engine was sent
    assembler.add_choices(batch)            # an engine's responses, as they arrive (rollout thread)
    assembler.add_rewards({id: score})      # scores, as the reward service returns them (any thread)
    samples, dropped = assembler.samples()  # prompt order: what build_samples gives for the whole step

A prompt's group gets its advantages the moment its last reward lands, not after the whole step: the
rollout, the reward and the advantages of one step overlap. The result does not depend on the order
things arrived in: samples come out in prompt order, each group in the engine's choice order, exactly as
`build_samples` orders them, so a step trains on the same batch however the streams interleaved.

`Sample.version` is the policy version of the weights that generated the response; `staleness` is set
when the sample reaches the trainer (trainer version minus `version`, see rlslurm/rl/pipeline.py).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from rlslurm.errors import RlslurmError

Encode = Callable[[Any], list[int]]
"""A prompt (text, or a data row's messages) -> the token ids of the text the engine was sent for it."""


class Problem(Protocol):
    """What a group is made for: a data row (rlslurm/data/sample.py) or a task problem; only `prompt` is read."""

    @property
    def prompt(self) -> Any: ...


@dataclass
class Sample:
    """One response, as it reaches the loss."""

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    advantage: float
    version: int
    """Policy version of the weights that generated the response."""
    engine_logprobs: list[float]
    """Log-probability of each response token under those weights (the behaviour policy), from the engine."""
    staleness: int = 0
    """Policy versions the trainer is ahead of `version` when it trains on the sample (0 = fresh)."""
    response_mask: list[int] | None = None
    """Per response token, 1 where the model generated it and 0 where it did not (a multi-turn episode's tool
    results and template pieces: rlslurm/rl/episodes.py), which the loss skips; None = every token is the
    model's. `engine_logprobs` holds 0.0 at the 0s."""


@dataclass
class Experience:
    """What the controller hands every rank for one step, and what it measured making it."""

    samples: list[Sample]
    stats: dict = field(default_factory=dict)
    response_versions: dict[int, int] = field(default_factory=dict)
    """Policy version -> responses of the step generated with it (dropped groups too): staleness counts them."""

    def to_json(self) -> dict:
        """Plain JSON (a checkpoint's RL state keeps the experience made ahead of the trainer)."""
        return {"samples": [dataclasses.asdict(s) for s in self.samples], "stats": self.stats,
                "response_versions": {str(v): n for v, n in self.response_versions.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Experience":
        return cls([Sample(**s) for s in data["samples"]], dict(data["stats"]),
                   {int(v): int(n) for v, n in data["response_versions"].items()})


@dataclass(frozen=True)
class Advantages:
    """How a group's rewards become its responses' advantages (rl.baseline, rl.overlong; rlslurm/rl/config.py
    names each one's paper)."""

    baseline: str = "group_std"
    """group_std (GRPO) | group_mean (Dr. GRPO) | loo (RLOO)."""
    overlong: str = "none"
    """none | filter (a response cut at max_new_tokens stays out of the loss) | penalty (DAPO's soft one)."""
    max_new_tokens: int = 0
    """rollout.max_new_tokens: DAPO's L_max, where the penalty is whole."""
    buffer_tokens: int = 1
    """rl.overlong_buffer_tokens: DAPO's L_cache."""
    penalty: float = 1.0
    """rl.overlong_penalty: what the penalty takes at max_new_tokens."""

    @classmethod
    def of(cls, job) -> "Advantages":
        rl = job.rl
        return cls(baseline=rl.baseline, overlong=rl.overlong, max_new_tokens=job.rollout.max_new_tokens,
                   buffer_tokens=rl.overlong_buffer_tokens or 1, penalty=rl.overlong_penalty)

    def length_penalty(self, tokens: int) -> float:
        """DAPO eq. 13 (verl's overlong buffer): 0 up to max_new_tokens - buffer_tokens, then falling linearly
        to -penalty at max_new_tokens (a response cannot be longer here: the engine cuts it there)."""
        if self.overlong != "penalty":
            return 0.0
        excess = tokens - (self.max_new_tokens - self.buffer_tokens)
        return min(-excess / self.buffer_tokens * self.penalty, 0.0)

    def of_rewards(self, rewards: list[float], eps: float = 1e-6) -> list[float] | None:
        """The advantages of one group's rewards; None for a zero-variance group (every baseline gives it 0)."""
        if len(rewards) < 2:
            return None
        mean = sum(rewards) / len(rewards)
        var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
        if var < eps * eps:
            return None
        if self.baseline == "group_mean":
            return [r - mean for r in rewards]
        if self.baseline == "loo":
            k, total = len(rewards), sum(rewards)
            return [r - (total - r) / (k - 1) for r in rewards]
        std = math.sqrt(var)
        return [(r - mean) / (std + eps) for r in rewards]


GRPO = Advantages()
"""Plain GRPO's advantages: (r - mean) / std, no overlong handling."""


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float] | None:
    """GRPO: (r - mean) / std within one prompt's group; None for a zero-variance group (no signal)."""
    return GRPO.of_rewards(rewards, eps)


def overlong(choice: dict) -> bool:
    """Whether the engine cut the response at max_new_tokens (OpenAI's finish_reason `length`)."""
    return choice.get("finish_reason") == "length"


def group_samples(prompt_ids: list[int], choices: list[dict], rewards: list[float | None],
                  rule: Advantages = GRPO) -> list[Sample] | None:
    """One prompt's samples, or None when the group teaches nothing: a None reward (dropped by
    `reward.degrade: drop`) leaves the group, and fewer than two left, or all equal, is no signal. With
    rl.overlong penalty the length penalty is added to each reward first (the sample keeps the sum); with
    filter, a cut response's reward counts in the baseline but the response stays out of the loss (a group
    left with no response to train on is dropped too)."""
    kept = [i for i, r in enumerate(rewards) if r is not None]
    shaped = [rewards[i] + rule.length_penalty(len(choices[i]["token_ids"])) for i in kept]
    adv = rule.of_rewards(shaped)
    if adv is None:
        return None
    prompt_ids = list(prompt_ids)  # one list for the group: pickled once when broadcast to the ranks
    samples = [Sample(prompt_ids, list(choices[i]["token_ids"]), r, a, int(choices[i]["policy_version"]),
                      list(choices[i]["token_logprobs"]), response_mask=choices[i].get("loss_mask"))
               for i, r, a in zip(kept, shaped, adv) if not (rule.overlong == "filter" and overlong(choices[i]))]
    return samples or None


def build_samples(problems: list[Problem], choices: list[dict], rewards: list[float | None], k: int,
                  encode: Encode, rule: Advantages = GRPO) -> tuple[list[Sample], int]:
    """(samples, groups dropped): choices and rewards are prompt-major, k per prompt, in `problems` order;
    a group whose rewards are all equal teaches nothing and is left out (it would only add noise). A None
    reward is a response the reward service could not score under `reward.degrade: drop`: it leaves its
    group, and the rest of the group is normalised without it."""
    if len(choices) != len(problems) * k or len(rewards) != len(choices):
        raise RlslurmError(f"{len(choices)} responses and {len(rewards)} rewards for {len(problems)} prompts "
                           f"x {k} samples: the rollout lost or duplicated responses")
    samples, dropped = [], 0
    for g, problem in enumerate(problems):
        group = group_samples(encode(problem.prompt), choices[g * k:(g + 1) * k], rewards[g * k:(g + 1) * k], rule)
        if group is None:
            dropped += 1
        else:
            samples.extend(group)
    return samples, dropped


def choice_id(choice: dict) -> str:
    """A response's id within its step, as the reward service is told it: engine and choice index."""
    return f"{choice['engine']}:{choice['index']}"


class GroupAssembler:
    """One step's responses and rewards as they arrive; each prompt's samples once its group is complete.

    Choices carry `prompt_index` (position in `problems`), `engine` and `index` (the engine's choice
    order). Thread-safe: the rollout adds choices, the reward client's thread adds rewards.
    """

    def __init__(self, problems: list[Problem], k: int, encode: Encode, rule: Advantages = GRPO):
        self.problems, self.k, self.encode, self.rule = problems, k, encode, rule
        self._lock = threading.Lock()
        self._choices: dict[str, dict] = {}
        self._rewards: dict[str, float | None] = {}
        self._by_prompt: dict[int, list[str]] = {}
        self._groups: dict[int, list[Sample] | None] = {}  # prompt index -> its samples (None: dropped)

    def add_choices(self, batch: Iterable[dict]) -> None:
        with self._lock:
            for c in batch:
                cid = choice_id(c)
                if cid in self._choices:
                    raise RlslurmError(f"response {cid} arrived twice: the rollout duplicated responses")
                self._choices[cid] = c
                self._by_prompt.setdefault(int(c["prompt_index"]), []).append(cid)
                self._try_complete(int(c["prompt_index"]))

    def add_rewards(self, rewards: dict[str, float | None]) -> None:
        """Scores by choice id; a reward seen before is ignored (finish() hands over all of them again)."""
        with self._lock:
            touched = set()
            for cid, r in rewards.items():
                if cid not in self._rewards:
                    self._rewards[cid] = r
                    if cid in self._choices:
                        touched.add(int(self._choices[cid]["prompt_index"]))
            for g in sorted(touched):
                self._try_complete(g)

    def _try_complete(self, g: int) -> None:
        ids = self._by_prompt.get(g, [])
        if g in self._groups or len(ids) != self.k or any(cid not in self._rewards for cid in ids):
            return
        ids = sorted(ids, key=lambda cid: self._choices[cid]["index"])
        # An episode's prompt ids come with it (its chat template showed the row's tools: rlslurm/rl/episodes.py).
        prompt_ids = self._choices[ids[0]].get("episode_prompt_ids") or self.encode(self.problems[g].prompt)
        self._groups[g] = group_samples(prompt_ids, [self._choices[c] for c in ids],
                                        [self._rewards[c] for c in ids], self.rule)

    @property
    def complete_groups(self) -> int:
        with self._lock:
            return len(self._groups)

    def choices(self) -> list[dict]:
        """Every response so far, prompt-major, each group in the engine's choice order."""
        with self._lock:
            return sorted(self._choices.values(), key=lambda c: (c["prompt_index"], c["index"]))

    def rewards(self) -> list[float | None]:
        """The rewards of `choices()`, in that order."""
        with self._lock:
            ordered = sorted(self._choices.values(), key=lambda c: (c["prompt_index"], c["index"]))
            return [self._rewards[choice_id(c)] for c in ordered]

    def groups(self) -> list[list[Sample] | None]:
        """Each prompt's samples (None: the group was dropped), in prompt order; `samples` checks completeness."""
        self.samples()
        with self._lock:
            return [self._groups[g] for g in range(len(self.problems))]

    def samples(self) -> tuple[list[Sample], int]:
        """(samples in prompt order, groups dropped), as build_samples gives them; raises when a prompt's
        group is not complete (responses lost, duplicated, or unscored)."""
        with self._lock:
            if len(self._groups) != len(self.problems):
                missing = [g for g in range(len(self.problems)) if g not in self._groups]
                g = missing[0]
                raise RlslurmError(
                    f"{len(self._choices)} responses and {len(self._rewards)} rewards for {len(self.problems)} "
                    f"prompts x {self.k} samples: {len(missing)} groups incomplete (prompt {g} has "
                    f"{len(self._by_prompt.get(g, []))} responses): the rollout lost or duplicated responses")
            samples = [s for g in range(len(self.problems)) for s in (self._groups[g] or [])]
            return samples, sum(group is None for group in self._groups.values())

"""The reward's types, which every part of rlslurm/reward/ shares: the item a scorer scores (and `item_for`, the
one function that makes it from a data row and a response, for the RL controller, its held-out evaluation and
`rlslurm score` alike), what a scorer returns, what the service answers, and the scorer protocol.

    item = item_for(sample, response="...", id="3:17")
    scored = await scorer.score(item)                  # Scored(score, reason): rlslurm/reward/scorers.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from rlslurm.data.sample import Sample


@dataclass(frozen=True)
class Item:
    """One response to score, with what its scorer needs (a reference answer, or unit tests)."""

    id: str
    response: str
    prompt: str = ""
    reference: str = ""
    """The row's ground truth as text (a non-text ground truth is JSON-encoded by whoever builds the item)."""
    reference_is_json: bool = False
    """The reference is JSON of a non-text ground truth (a list, dict or number): a reward function gets it
    decoded (function.py); text references are never parsed."""
    tests: str = ""
    """A code problem's tests (HumanEval's `test`: defines check(candidate))."""
    entry_point: str = ""
    """HumanEval's entry point: the tests end with check(<entry_point>) when it is set."""
    data_source: str = ""
    """verl's data_source column: the first argument of a compute_score function."""
    extra: str = ""
    """The row's other columns as a JSON object (verl's extra_info; TRL's reward-function keyword arguments)."""


@dataclass(frozen=True)
class Scored:
    """A reward (rule, code, judge: in [0, 1]; a user's function: any finite number), or None when the
    scorer could not decide (a judge parse failure, a function that raised)."""

    score: float | None
    reason: str


class ScorerUnavailable(Exception):
    """The scorer's upstream failed (connection, HTTP error): retrying the item may succeed."""


class Scorer(Protocol):
    async def score(self, item: Item) -> Scored: ...


MAX_REASON_CHARS = 300
"""A verdict's `reason` is cut to this: it must not echo a response of any size back."""


@dataclass(frozen=True)
class Verdict:
    """One item's outcome as the service answers it: scored (a number), unscored (the scorer decided it cannot
    score: a function that raised, a judge reply without a mark) or error (timeout, upstream down: retryable)."""

    score: float | None
    status: str
    reason: str


def short(text: str, chars: int = 80) -> str:
    """repr of `text`, cut to about `chars` characters: a reason must not echo a whole response."""
    return repr(text) if len(text) <= chars else repr(text[:chars]) + f"... ({len(text)} chars)"


def as_text(value: Any) -> str:
    """A ground truth as the wire carries it: text as is, None as "", anything else as JSON (a list of
    accepted answers, a dict) that a user's function gets back decoded (rlslurm/reward/function.py)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def prompt_text(sample: Sample) -> str:
    """The prompt a scorer reads: the text itself, or a conversation's last user message (a judge grades
    the question; a code scorer's HumanEval prompt is always text)."""
    if isinstance(sample.prompt, str):
        return sample.prompt
    users = [m.get("content", "") for m in sample.prompt if m.get("role") == "user"]
    return users[-1] if users else (sample.prompt[-1].get("content", "") if sample.prompt else "")


def item_for(sample: Sample, response: str, id: str, messages: list[dict] | None = None) -> Item:
    """The reward item of `response` to `sample`: its reference (verl's reward_model.ground_truth), tests
    and entry point (HumanEval), data_source and every other column (`extra`, JSON). `messages`: a multi-turn
    episode's whole conversation (response = its final answer), which a reward function finds in its extra_info
    as `messages`, with `num_turns` (the model's turns), as verl's agent loop hands them on."""
    extra = sample.extra or {}
    if messages is not None:
        turns = {"messages": messages, "num_turns": sum(m.get("role") == "assistant" for m in messages)}
        info = extra.get("extra_info")
        extra = {**extra, "extra_info": {**info, **turns}} if isinstance(info, dict) else {**extra, **turns}
    return Item(id=id, response=response, prompt=prompt_text(sample), reference=as_text(sample.reference),
                reference_is_json=sample.reference is not None and not isinstance(sample.reference, str),
                tests=sample.tests or "", entry_point=str(extra.get("entry_point") or ""),
                data_source=str(extra.get("data_source") or ""), extra=json.dumps(extra, default=str))

"""A data row and a response as the reward service scores them: one function, for the RL controller,
its held-out evaluation and `rlslurm score`, so the three hand a scorer the same item.

    item = item_for(sample, response="...", id="3:17")
"""

from __future__ import annotations

import json
from typing import Any

from rlslurm.data.sample import Sample
from rlslurm.reward.scorers import Item


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


def item_for(sample: Sample, response: str, id: str) -> Item:
    """The reward item of `response` to `sample`: its reference (verl's reward_model.ground_truth), tests
    and entry point (HumanEval), data_source and every other column (`extra`, JSON)."""
    extra = sample.extra or {}
    return Item(id=id, response=response, prompt=prompt_text(sample), reference=as_text(sample.reference),
                reference_is_json=sample.reference is not None and not isinstance(sample.reference, str),
                tests=sample.tests or "", entry_point=str(extra.get("entry_point") or ""),
                data_source=str(extra.get("data_source") or ""), extra=json.dumps(extra, default=str))

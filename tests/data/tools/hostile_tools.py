"""User tools for the tool tests (rollout.tools: tests/data/tools/hostile_tools.py:NAME): one well-behaved, the
others hostile in each way a tool can be: it raises, hangs, returns megabytes, exits its process."""

import os
import time


def echo(text: str) -> str:
    """Say the text back.

    Args:
        text: What to say.
    """
    return text


def boom() -> str:
    """Always fails."""
    raise ValueError("the tool broke")


def sleepy() -> str:
    """Never answers."""
    time.sleep(3600)
    return "late"


def big() -> str:
    """Five megabytes of output."""
    return "x" * 5_000_000


def quits() -> str:
    """Kills its own worker process."""
    os._exit(3)


def grade(answer: str, *, ground_truth: str = "") -> str:
    """Whether the answer is right (the row's ground truth comes from verl's tools_kwargs).

    Args:
        answer: The answer to check.
    """
    return "right" if answer == ground_truth else "wrong"


lookup_schema = {"name": "lookup", "description": "Declared beside the function.",
                 "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}


def lookup(key):
    return {"key": key, "value": len(key)}

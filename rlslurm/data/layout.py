"""Which columns of a user's rows mean what (verl, TRL, named columns), and one row read as a `Sample`.

    layout = resolve(job.data, column_names)            # DataError when no layout fits the columns
    sample = layout.sample(row_dict, index)             # RowError(column, message) for a bad row

verl:   prompt (messages), reward_model.ground_truth, everything else (data_source, extra_info) in extra.
TRL:    prompt [+ completion] (text or messages), or messages (the last assistant turn is the completion).
columns: only what data.columns names (OpenRLHF's input_key / label_key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlslurm.data.config import DataConfig
from rlslurm.data.messages import MessageError, read_messages, read_tools, uses_tools
from rlslurm.data.sample import Sample
from rlslurm.errors import ConfigError

REFERENCE_NAMES = ("ground_truth", "answer", "solution", "reference")
"""Columns auto-detection takes as the ground truth, first present wins (verl's is reward_model.ground_truth)."""


class DataError(ConfigError):
    """A data file that cannot be used as configured: missing, unreadable, or a bad row (named by file, row
    and column)."""


class RowError(ValueError):
    """One row broke a rule; `column` is the column (dotted path) it broke it in."""

    def __init__(self, column: str, message: str):
        super().__init__(message)
        self.column, self.message = column, message


_MISSING = object()


def lookup(row: dict, path: str) -> Any:
    """The value at a dotted path (reward_model.ground_truth) of a row; _MISSING when any part is absent."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def has_column(names: list[str] | dict, path: str) -> bool:
    """Whether the top-level column of `path` is present (struct fields are checked row by row)."""
    return path.split(".")[0] in names


@dataclass(frozen=True)
class Layout:
    """The resolved column of each Sample field (None: the rows have none)."""

    name: str
    prompt: str | None
    completion: str | None
    messages: str | None
    reference: str | None
    tests: str | None

    def used(self) -> set[str]:
        """Top-level columns a Sample field takes; the rest go to `extra`."""
        return {p.split(".")[0] for p in (self.prompt, self.completion, self.messages, self.reference, self.tests)
                if p is not None}

    def describe(self) -> str:
        fields = {k: getattr(self, k) for k in ("prompt", "completion", "messages", "reference", "tests")}
        return f"{self.name} ({', '.join(f'{k}: {v}' for k, v in fields.items() if v)})"

    def sample(self, row: dict, index: int, *, need: frozenset[str] = frozenset()) -> Sample:
        """Row `index` as a Sample; RowError names the column of the first broken rule. `need`: the Sample
        fields this job cannot do without (completion for SFT, reference or tests for RL), and
        "structured_reference" when a list or mapping ground truth is taken (a reward function's)."""
        completion = turns = None
        if self.messages is not None:
            messages = _messages(_get(row, self.messages, True), self.messages)
            if messages[-1]["role"] == "assistant" and uses_tools(messages):
                # A tool-using conversation: every assistant turn after the first user's question is learned
                # (SFT), the tool turns between them are given (rlslurm/data/turns.py).
                first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
                prompt, turns, completion = messages[:first], messages[first:], messages[-1]["content"]
                if not prompt:
                    raise RowError(self.messages, "holds only an assistant turn: no prompt before it")
            elif messages[-1]["role"] == "assistant":
                prompt, completion = messages[:-1], messages[-1]["content"]
                if not prompt:
                    raise RowError(self.messages, "holds only an assistant turn: no prompt before it")
            else:
                prompt = messages
        else:
            prompt = _prompt(_get(row, self.prompt, True), self.prompt)
        if self.completion is not None:
            completion = _completion(_get(row, self.completion, "completion" in need), self.completion)
        if "completion" in need and completion is None:
            column = self.messages or self.completion or "completion"
            raise RowError(column, "has no completion to learn (an SFT row needs one: a completion column, or "
                                   "messages ending with an assistant turn)")
        reference = None
        if self.reference is not None:
            reference = _get(row, self.reference, "reference" in need)
            structured = "structured_reference" in need and isinstance(reference, (list, dict))
            if reference is not None and not structured and (
                    isinstance(reference, bool) or not isinstance(reference, (str, int, float))):
                raise RowError(self.reference, f"is a {_kind(reference)}; a ground truth must be text or a number "
                                               "(a list or mapping reaches a reward function only: reward.scorer = "
                                               "function)")
        elif "reference" in need:
            raise RowError("reference", "no ground-truth column: set data.columns.reference")
        tests = None
        if self.tests is not None:
            tests = _get(row, self.tests, "tests" in need)
            if tests is not None and not isinstance(tests, str):
                raise RowError(self.tests, f"is a {_kind(tests)}; tests must be text (Python code)")
        elif "tests" in need:
            raise RowError("tests", "no tests column: set data.columns.tests")
        used = self.used()
        extra = {k: v for k, v in row.items() if k not in used}
        if extra.get("tools") is not None:  # TRL's tools column: the schemas a chat template shows the model
            try:
                extra["tools"] = read_tools(extra["tools"], "tools")
            except MessageError as e:
                raise RowError(e.column, e.message) from None
        return Sample(prompt=prompt, completion=completion, reference=reference, tests=tests, extra=extra, row=index,
                      turns=turns)


def _get(row: dict, path: str, required: bool) -> Any:
    value = lookup(row, path)
    if value is _MISSING or (value is None and required):
        if required:
            raise RowError(path, "is missing" if value is _MISSING else "is null")
        return None
    return value


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list", bool: "boolean", type(None): "null"}.get(type(value), type(value).__name__)


def _prompt(value: Any, column: str):
    if isinstance(value, str):
        if not value.strip():
            raise RowError(column, "is an empty prompt")
        return value
    if isinstance(value, list):
        return _messages(value, column)
    raise RowError(column, f"is a {_kind(value)}; a prompt must be text or a list of {{role, content}} messages")


def _completion(value: Any, column: str) -> str | None:
    if value is None or isinstance(value, str):
        if value is not None and not value.strip():
            raise RowError(column, "is an empty completion")
        return value
    if isinstance(value, list):  # TRL's conversational completion: the assistant turn(s)
        messages = _messages(value, column)
        if any(m["role"] != "assistant" for m in messages):
            raise RowError(column, "holds a message that is not the assistant's")
        return "".join(m["content"] for m in messages)
    raise RowError(column, f"is a {_kind(value)}; a completion must be text or assistant messages")


def _messages(value: Any, column: str) -> list[dict]:
    try:
        return read_messages(value, column)
    except MessageError as e:
        raise RowError(e.column, e.message) from None


def resolve(data: DataConfig, names: list[str], source: str) -> Layout:
    """The layout of rows with top-level columns `names` under data.layout and data.columns; DataError when
    the columns it needs are absent."""
    c = data.columns
    name = data.layout
    if name == "auto":
        if c.messages or ("messages" in names and not c.prompt):
            name = "trl_messages"
        elif "prompt" in names and "reward_model" in names:
            name = "verl"
        elif "prompt" in names or c.prompt:
            name = "trl_prompt_completion"
        else:
            raise DataError(f"{source}: cannot tell the layout from the columns {_names(names)}: expected "
                            f"prompt (+ completion or reward_model) or messages; set data.layout and data.columns "
                            f"(e.g. data.columns.prompt: question)")
    reference = c.reference or ("reward_model.ground_truth" if name == "verl" else
                                next((n for n in REFERENCE_NAMES if n in names), None))
    tests = c.tests or ("test" if "test" in names else None)
    if name == "trl_messages":
        layout = Layout(name, None, c.completion, c.messages or "messages", reference, tests)
    elif name == "columns":
        layout = Layout(name, c.prompt, c.completion, c.messages, c.reference, c.tests)
    else:
        layout = Layout(name, c.prompt or "prompt", c.completion or ("completion" if "completion" in names else None),
                        None, reference, tests)
    for key in ("prompt", "completion", "messages", "reference", "tests"):
        path = getattr(layout, key)
        if path is not None and not has_column(names, path):
            raise DataError(f"{source}: column {path.split('.')[0]!r} is missing (data.layout = {name}, the "
                            f"{key} column {path!r}); the file has {_names(names)}: set data.columns.{key}")
    return layout


def _names(names) -> str:
    shown = list(names)[:20]
    return "[" + ", ".join(repr(n) for n in shown) + (", ..." if len(names) > 20 else "") + "]"

"""Tool calls read from a model turn's text, in the format its chat template writes them.

    fmt = call_format("auto", tokenizer, tool_names)     # rollout.tool_format
    turn = fmt.parse(text)          # Turn(answer="...", calls=[Call(name, arguments) | Call(error=...)])

hermes: Hermes / Qwen / many instruct templates: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
JSON object per tag, any number of tags in a turn. What the model wrote outside the tags is its answer.

embedded: the embedded character model's own format (rlslurm/tokenizer.py CHAT_TEMPLATE), in its alphabet of
digits and operators: `[ARG]` calls the first tool of rollout.tools with ARG as its one argument (there are no
letters to name a tool with); the text outside the brackets is its answer.

A call that cannot be read (an unclosed tag, JSON that does not parse, no name, arguments that are no mapping)
comes back as a Call with `error` set and kind `malformed`: the episode answers it with a short tool error, as
it answers an unknown tool or bad arguments (rlslurm/tools/toolbox.py), and counts it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

MAX_CALLS_PER_TURN = 8
"""Tool calls read from one model turn; more are answered with one error (a model that loops on calls)."""


@dataclass(frozen=True)
class Call:
    """One tool call a model turn made: `name` and `arguments`, or `error` (kind `malformed`) when unreadable."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    text: str = ""
    """The call as the model wrote it (cut to 200 characters): an error message quotes it."""

    def as_message(self) -> dict:
        """The call in an assistant message's `tool_calls` (OpenAI / TRL layout)."""
        return {"type": "function", "function": {"name": self.name or "?", "arguments": dict(self.arguments)}}


@dataclass(frozen=True)
class Turn:
    """A model turn, read: its answer text (the calls taken out) and its calls."""

    answer: str
    calls: list[Call]


def _cut(text: str, chars: int = 200) -> str:
    return text if len(text) <= chars else text[:chars] + "..."


class HermesFormat:
    """`<tool_call>{json}</tool_call>` (Hermes, Qwen2.5 / Qwen3, and the templates that copy them)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> Turn:
        calls: list[Call] = []
        answer: list[str] = []
        rest = text
        while True:
            start = rest.find(self.OPEN)
            if start < 0:
                stray = rest.find(self.CLOSE)
                if stray >= 0:
                    calls.append(Call(error=f"{self.CLOSE} without {self.OPEN}", text=_cut(rest[max(0, stray - 80):])))
                    rest = rest[:stray] + rest[stray + len(self.CLOSE):]
                answer.append(rest)
                break
            answer.append(rest[:start])
            end = rest.find(self.CLOSE, start)
            if end < 0:
                calls.append(Call(error=f"{self.OPEN} never closed by {self.CLOSE}", text=_cut(rest[start:])))
                break
            calls.append(self._call(rest[start + len(self.OPEN):end]))
            rest = rest[end + len(self.CLOSE):]
        return Turn("".join(answer).strip(), calls)

    @staticmethod
    def _call(body: str) -> Call:
        text = _cut(body.strip())
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            return Call(error=f"the call is not JSON ({e.msg} at character {e.pos})", text=text)
        if not isinstance(value, dict):
            return Call(error="the call must be a JSON object {\"name\": ..., \"arguments\": {...}}", text=text)
        name, arguments = value.get("name"), value.get("arguments", value.get("parameters", {}))
        if not isinstance(name, str) or not name:
            return Call(error="the call names no tool (\"name\")", text=text)
        if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's wire does
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return Call(name=name, error=f"its arguments are not JSON ({e.msg})", text=text)
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return Call(name=name, error="its \"arguments\" must be a JSON object", text=text)
        return Call(name=name, arguments=arguments, text=text)


class EmbeddedFormat:
    """`[ARG]`: a call to `tool` (the first of rollout.tools) with `ARG` as its argument `parameter`."""

    name = "embedded"
    _CALL = re.compile(r"\[([^\[\]]*)\]")

    def __init__(self, tool: str, parameter: str):
        self.tool, self.parameter = tool, parameter

    def parse(self, text: str) -> Turn:
        calls = [Call(name=self.tool, arguments={self.parameter: m.group(1)}, text=_cut(m.group(0)))
                 for m in self._CALL.finditer(text)]
        rest = self._CALL.sub("", text)
        if "[" in rest or "]" in rest:  # an unclosed or stray bracket, or a call nested in another
            calls.append(Call(error="a call is written [ARGUMENT]: an unclosed or stray bracket", text=_cut(text)))
            rest = rest.replace("[", "").replace("]", "")
        return Turn(rest.strip(), calls)


def call_format(name: str, tokenizer, tools: list[tuple[str, str | None]]):
    """The format of rollout.tool_format = `name` (auto: embedded for the embedded character tokenizer, hermes
    otherwise); `tools` is [(tool name, its first parameter)] in rollout.tools' order."""
    from rlslurm.tokenizer import is_embedded

    if name == "auto":
        name = "embedded" if is_embedded(tokenizer) else "hermes"
    if name == "hermes":
        return HermesFormat()
    tool, parameter = tools[0]
    return EmbeddedFormat(tool, parameter or "input")

"""Chat messages as rows carry them, tool turns included: checked once and normalised for the chat template.

    messages = read_messages(row["messages"], "messages")   # RowError naming messages[i].<field>
    tools = read_tools(row.get("tools"), "tools")           # TRL's `tools` column: JSON schemas (or their JSON)

A message is {role, content}; role one of system, user, assistant, tool. Tool-using conversations (TRL's
conversational layout, OpenAI's) add:

- an assistant turn's `tool_calls`: [{"type": "function", "function": {"name": ..., "arguments": {...}}}]; its
  content may then be empty or null. `arguments` may come as a JSON string (OpenAI's wire form): it is parsed,
  since Hugging Face chat templates expect a mapping;
- a tool turn's `name` and `tool_call_id` (text).

Arrow (every file `datasets` opens, jsonl too) gives a struct column the union of the fields of all its rows,
null where a row had none: a message gets `tool_calls: null`, a call's arguments the other tools' argument
names, a schema other schemas' keys. Nulls are dropped here (in arguments and schemas at any depth), so a
template and a tool see the same row from a jsonl file and a parquet file; an argument given as null reads as
not given.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
MAX_TOOL_CALLS = 64
"""Tool calls one assistant turn may carry in a data row."""


class MessageError(ValueError):
    """One field of one message broke a rule; `column` is its dotted path (messages[2].tool_calls[0])."""

    def __init__(self, column: str, message: str):
        super().__init__(message)
        self.column, self.message = column, message


def no_nulls(value: Any) -> Any:
    """`value` with every null mapping entry dropped, at any depth (the Arrow union's fill)."""
    if isinstance(value, dict):
        return {k: no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [no_nulls(v) for v in value]
    return value


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list", bool: "boolean", type(None): "null"}.get(type(value), type(value).__name__)


def read_tool_call(value: Any, column: str) -> dict:
    """One tool call as {"type": "function", "function": {"name", "arguments": mapping}} (+ "id" when given);
    OpenAI's nested form and the flat {"name", "arguments"} both read."""
    if not isinstance(value, dict):
        raise MessageError(column, f"is a {_kind(value)}; a tool call is {{type: function, function: {{name, "
                                   "arguments}}}")
    fn = value.get("function") if isinstance(value.get("function"), dict) else value
    name, arguments = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name.strip():
        raise MessageError(f"{column}.function.name", "must be the tool's name (text)")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise MessageError(f"{column}.function.arguments", f"is not JSON ({e.msg} at {e.pos})") from None
    if not isinstance(arguments, dict):
        raise MessageError(f"{column}.function.arguments", f"is a {_kind(arguments)}; must be a mapping of "
                                                           "argument names to values")
    call = {"type": "function", "function": {"name": name, "arguments": no_nulls(arguments)}}
    if isinstance(value.get("id"), str):
        call["id"] = value["id"]
    return call


def read_message(value: Any, column: str) -> dict:
    """One message, normalised (the fields a template reads, no nulls)."""
    if not isinstance(value, dict) or not isinstance(value.get("role"), str):
        raise MessageError(column, "must be a message: {role: text, content: text}")
    role = value["role"]
    if role not in ROLES:
        raise MessageError(f"{column}.role", f"= {role[:40]!r} must be one of {', '.join(ROLES)}")
    calls = value.get("tool_calls")
    if calls is not None and role != "assistant":
        raise MessageError(f"{column}.tool_calls", f"on a {role} message: only an assistant turn calls tools")
    if calls is not None and (not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS):
        raise MessageError(f"{column}.tool_calls", f"must be a list of at most {MAX_TOOL_CALLS} tool calls")
    content = value.get("content")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise MessageError(column, "must be a message: {role: text, content: text}")
    out: dict = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = [read_tool_call(c, f"{column}.tool_calls[{i}]") for i, c in enumerate(calls)]
    if role == "tool":
        for key in ("name", "tool_call_id"):
            if value.get(key) is not None:
                if not isinstance(value[key], str):
                    raise MessageError(f"{column}.{key}", f"is a {_kind(value[key])}; must be text")
                out[key] = value[key]
    return out


def read_messages(value: Any, column: str) -> list[dict]:
    """A non-empty conversation, each message normalised; MessageError names the first bad field."""
    if not isinstance(value, list) or not value:
        raise MessageError(column, f"is a {_kind(value) if value != [] else 'empty list'}; it must be a non-empty "
                                   f"list of {{role, content}} messages")
    out = [read_message(m, f"{column}[{i}]") for i, m in enumerate(value)]
    if not any(m["content"].strip() for m in out if m["role"] != "assistant"):
        raise MessageError(column, "is an empty prompt: no message before the answer has text")
    return out


def uses_tools(messages: list[dict]) -> bool:
    """Whether a conversation holds a tool call or a tool turn (then every assistant turn of it is learned)."""
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def read_tools(value: Any, column: str) -> list[dict] | None:
    """TRL's `tools` column: a list of JSON schemas ({"type": "function", "function": {name, description,
    parameters}}), each possibly as its JSON text; None when the row has none."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise MessageError(column, f"is not JSON ({e.msg} at {e.pos})") from None
    if not isinstance(value, list):
        raise MessageError(column, f"is a {_kind(value)}; must be a list of tool JSON schemas")
    tools = []
    for i, tool in enumerate(value):
        if isinstance(tool, str):
            try:
                tool = json.loads(tool)
            except json.JSONDecodeError as e:
                raise MessageError(f"{column}[{i}]", f"is not JSON ({e.msg} at {e.pos})") from None
        tool = no_nulls(tool)
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError(f"{column}[{i}]", "must be a tool schema: {type: function, function: {name, ...}}")
        tools.append(tool if "function" in tool else {"type": "function", "function": tool})
    return tools


def tool_names(tools: list[dict] | None) -> list[str] | None:
    """The names of a `tools` column's schemas (None: the row names none)."""
    return None if tools is None else [t["function"]["name"] for t in tools]

"""A tool's JSON schema (what the chat template shows the model), from a Python function, and the check of a
call's arguments against it.

    schema = function_schema(fn, "lookup")     # {"type": "function", "function": {name, description, parameters}}
    problem = check_arguments(schema, {"city": "Oslo"})      # None, or what is wrong, in one line

From the signature and the docstring: the first paragraph is the description; Google-style `Args:` lines
(`name (type): text` or `name: text`) describe the parameters; annotations give the JSON types (str string,
int integer, float number, bool boolean, list array, dict object; Optional[X] / X | None is X and not
required). Parameters with a default are optional; keyword-only parameters (after `*`) are the row's context
(verl's tools_kwargs: rlslurm/tools/toolbox.py), never shown to the model. A function may instead declare its
schema beside it, as a module-level dict named `<name>_schema` (taken as it is).
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any, Callable

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               tuple: "array"}
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def _json_type(annotation: Any) -> tuple[str | None, bool]:
    """(JSON type or None when unknown, optional: the annotation admits None)."""
    if annotation is inspect.Parameter.empty:
        return None, False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        inner = _json_type(args[0])[0] if len(args) == 1 else None
        return inner, optional
    return _JSON_TYPES.get(origin or annotation), False


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """(description: the first paragraph, {parameter: its description} from an `Args:` section)."""
    doc = inspect.getdoc(fn) or ""
    paragraphs = doc.split("\n\n")
    description = " ".join(paragraphs[0].split()) if paragraphs and not paragraphs[0].lstrip().startswith("Args") \
        else ""
    described: dict[str, str] = {}
    in_args, current = False, None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args, current = True, None
            continue
        if in_args:
            if not stripped or (stripped.endswith(":") and not line.startswith((" ", "\t"))):
                if stripped.endswith(":"):
                    in_args = False
                continue
            m = _ARG_LINE.match(line)
            if m and not line.startswith(" " * 8):
                current = m.group(1).lstrip("*")
                described[current] = m.group(3).strip()
            elif current:
                described[current] = (described[current] + " " + stripped).strip()
    return description, described


def function_schema(fn: Callable, name: str) -> dict:
    """The OpenAI-style function schema of `fn` under `name` (the module docstring's rules)."""
    description, described = _docstring(fn)
    properties: dict[str, dict] = {}
    required: list[str] = []
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: read as written
        hints = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            continue  # *args, **kwargs and keyword-only (the row's context) are not the model's to fill
        json_type, optional = _json_type(hints.get(param.name, param.annotation))
        prop: dict[str, Any] = {}
        if json_type:
            prop["type"] = json_type
        if described.get(param.name):
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is inspect.Parameter.empty and not optional:
            required.append(param.name)
    return {"type": "function", "function": {
        "name": name, "description": description or f"The tool {name}.",
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def check_arguments(schema: dict, arguments: dict) -> str | None:
    """What is wrong with a call's `arguments` against `schema` (one line), or None: a required one missing, one
    the tool does not take, or a value of the wrong JSON type."""
    params = schema["function"].get("parameters") or {}
    properties = params.get("properties") or {}
    missing = [p for p in params.get("required", []) if p not in arguments]
    if missing:
        return f"missing argument {missing[0]!r} (it takes {sorted(properties)})"
    unknown = [a for a in arguments if a not in properties]
    if unknown and params.get("additionalProperties", False) is not True:
        return f"unknown argument {unknown[0][:40]!r} (it takes {sorted(properties)})"
    for key, value in arguments.items():
        want = (properties.get(key) or {}).get("type")
        if want and not _is_json_type(value, want):
            return f"argument {key!r} must be {want}, got {_type_name(value)}"
    return None


def _is_json_type(value: Any, want: str | list) -> bool:
    if isinstance(want, list):
        return any(_is_json_type(value, w) for w in want)
    checks = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool)
              or isinstance(v, float) and v.is_integer(),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict),
              "null": lambda v: v is None}
    return checks.get(want, lambda v: True)(value)


def _type_name(value: Any) -> str:
    return {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)

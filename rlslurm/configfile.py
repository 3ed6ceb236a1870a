"""Strict loading of YAML into frozen, documented dataclasses.

Every component owns a frozen keyword-only dataclass with a docstring under each field. This module
turns a YAML mapping into such a dataclass once, at load, and names the key as the user wrote it:

    job.yaml: watchdog.timeout_s = 0 must be > 0 (seconds without progress before a rank counts as hung)

A config class states its own value rules in `__post_init__` with `check(...)`, which raises
`FieldError` naming the field; the loader adds the file and the dotted path of the section. Every number
has a range (`check_range`: finite, the bounds in the field's docstring and in the message), every string
a shape (`check_text`, `check_name`, `check_path`: bounded, no control characters); the file itself is
read by rlslurm/safeyaml.py, which refuses hostile YAML (binary, deep, alias bombs, duplicate keys).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from rlslurm.errors import ConfigError
from rlslurm.safeyaml import clip, excerpt, read_file


class FieldError(ValueError):
    """A value rule broken inside one config object; `key` is relative to that object."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key
        self.message = message


def check(condition: bool, key: str, message: str) -> None:
    """Raise FieldError(key, message) unless condition holds (`raise`, never `assert`)."""
    if not condition:
        raise FieldError(key, message)


def span(lo: float, hi: float, low_open: bool = False) -> str:
    """A range as its field's docstring writes it: `[1, 64]`, `(0, 1e6]`."""
    return f"{'(' if low_open else '['}{_bound(lo)}, {_bound(hi)}]"


def _bound(value: float) -> str:
    """0.001, 64, 86400, 4294967295 as written; powers of ten from 1e7 up as 1e8."""
    if abs(value) >= 1e7 and math.log10(abs(value)).is_integer():
        return f"{'-' if value < 0 else ''}1e{int(math.log10(abs(value)))}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


def check_range(value: float | None, key: str, lo: float, hi: float, *, low_open: bool = False,
                note: str = "") -> None:
    """Raise FieldError unless `value` (None passes: not set) is a finite number in [lo, hi] ((lo, hi] with
    `low_open`). The message names the broken bound and the range, which the field's docstring states too;
    NaN, infinities and huge integers never get past it to the planner or the job."""
    if value is None:
        return
    rng = span(lo, hi, low_open)
    why = f" ({note}; range {rng})" if note else f" (range {rng})"
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(key, f"must be a finite number in {rng}{f' ({note})' if note else ''}")
    if low_open and value <= lo:
        raise FieldError(key, f"must be > {_bound(lo)}{why}")
    if value < lo:
        raise FieldError(key, f"must be >= {_bound(lo)}{why}")
    if value > hi:
        raise FieldError(key, f"must be <= {_bound(hi)}{why}")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def check_text(value: str | None, key: str, max_chars: int, *, lines: bool = False) -> None:
    """Free text (a label, a prompt, a rubric): at most `max_chars`, valid UTF-8, no control characters
    (newlines and tabs only with `lines`)."""
    if value is None:
        return
    check(len(value) <= max_chars, key, f"is {len(value):,} characters long; at most {max_chars:,}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(key, f"is not UTF-8 text (an undecodable byte at character {e.start})") from None
    bad = (_CONTROL_BUT_LINES if lines else _CONTROL).search(value)
    if bad:
        raise FieldError(key, f"must not contain control characters ({bad.group()!r} at character {bad.start()})")


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(value: str | None, key: str, what: str, max_chars: int = 64) -> None:
    """A name that becomes a file name or a SLURM name: letters, digits, '.', '_', '-', starting with a
    letter or digit, at most `max_chars`; `what` says where it goes."""
    if value is None:
        return
    check(bool(_NAME.fullmatch(value)) and len(value) <= max_chars, key,
          f"must be 1 to {max_chars} letters, digits, '.', '_' or '-', starting with a letter or digit ({what})")


def check_path(value: str | None, key: str) -> None:
    """A file system path: not empty, no control characters or surrounding blanks, at most 4096 bytes
    (PATH_MAX) with no part over 255 (NAME_MAX)."""
    if value is None:
        return
    check_text(value, key, 4096)
    check(bool(value) and value == value.strip(), key, "must be a path: not empty, no leading or trailing blanks")
    check(len(value.encode("utf-8")) <= 4096, key, "is longer than 4096 bytes (PATH_MAX)")
    longest = max(value.split("/"), key=len)
    check(len(longest.encode("utf-8")) <= 255, key,
          f"has a part of {len(longest.encode('utf-8'))} bytes; at most 255 (NAME_MAX)")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return "{...}" if dataclasses.is_dataclass(value) else value
    return "required"


def describe_keys(cls: type) -> str:
    """`name (default X)` for every field, for error messages that list the valid keys."""
    return ", ".join(f"{f.name} (default {_default_of(f)!r})" for f in dataclasses.fields(cls))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


class _Loader:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, message: str) -> ConfigError:
        where = f"{key} " if key else ""
        return ConfigError(f"{self.source}: {where}{message}")

    def value(self, tp: Any, raw: Any, key: str, doc: str) -> Any:
        origin = typing.get_origin(tp)
        hint = f" ({doc.rstrip('.')})" if doc else ""
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, raw, key)
        if origin in (Union, types.UnionType):
            args = typing.get_args(tp)
            if raw is None and type(None) in args:
                return None
            for arg in args:
                if arg is type(None):
                    continue
                try:
                    return self.value(arg, raw, key, doc)
                except ConfigError:
                    continue
            raise self.fail(key, f"= {excerpt(raw)} must be {_type_name(tp)}{hint}")
        if origin is Literal:
            allowed = typing.get_args(tp)
            if raw not in allowed:
                raise self.fail(key, f"= {excerpt(raw)} must be one of {', '.join(map(repr, allowed))}{hint}")
            return raw
        if origin in (list, tuple):
            if not isinstance(raw, list):
                raise self.fail(key, f"= {excerpt(raw)} must be a list{hint}")
            (item,) = typing.get_args(tp)[:1]
            items = [self.value(item, v, f"{key}[{i}]", doc) for i, v in enumerate(raw)]
            return tuple(items) if origin is tuple else items
        if origin is dict:
            if not isinstance(raw, dict):
                raise self.fail(key, f"= {excerpt(raw)} must be a mapping{hint}")
            _, item = typing.get_args(tp)
            return {str(k): self.value(item, v, f"{key}.{clip(str(k), 60)}", doc) for k, v in raw.items()}
        if tp is Any:
            return raw
        if tp is bool:
            if not isinstance(raw, bool):
                raise self.fail(key, f"= {excerpt(raw)} must be true or false{hint}")
            return raw
        if tp is int:
            if isinstance(raw, bool) or not isinstance(raw, int):
                raise self.fail(key, f"= {excerpt(raw)} must be an integer{hint}")
            return raw
        if tp is float:
            # len first: the pattern backtracks quadratically on a long run of digits (16,000: 5 s)
            if isinstance(raw, str) and len(raw) <= 64 and _SCIENTIFIC.fullmatch(raw.strip()):
                raw = float(raw)  # PyYAML reads `1e-5` (no dot) as a string: YAML 1.1 wants `1.0e-5`
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                raise self.fail(key, f"= {excerpt(raw)} must be a number{hint}")
            return float(raw)
        if tp is str:
            if not isinstance(raw, str):
                raise self.fail(key, f"= {excerpt(raw)} must be a string{hint}")
            return raw
        raise TypeError(f"config type {tp!r} at {key} is not supported by the loader")

    def dataclass(self, cls: type, raw: Any, key: str) -> Any:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise self.fail(key, f"must be a mapping with keys: {describe_keys(cls)}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in raw:
            if name not in fields:
                shown = clip(str(name), 60)  # a key can be as long as the file: difflib is quadratic in it
                close = difflib.get_close_matches(shown, fields, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                where = f"{key}.{shown}" if key else shown
                section = key or "the top level"
                raise self.fail(
                    where, f"is not a key of {section}.{hint} Valid keys: {describe_keys(cls)}"
                )
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        kwargs = {}
        for name, f in fields.items():
            sub = f"{key}.{name}" if key else name
            if name in raw:
                kwargs[name] = self.value(hints[name], raw[name], sub, docs.get(name, ""))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise self.fail(sub, f"is required ({docs.get(name, 'no default')})")
        try:
            return cls(**kwargs)
        except FieldError as e:
            sub = f"{key}.{e.key}" if key else e.key
            doc = field_docs(cls).get(e.key.split(".")[0].split("[")[0], "")
            value = _lookup(kwargs, e.key)
            shown = f"= {excerpt(value)} " if value is not _NOTHING else ""
            hint = f" ({doc.rstrip('.')})" if doc and "(" not in e.message else ""
            if e.message.startswith(e.key):  # a cross-field message that names its keys itself
                raise ConfigError(f"{self.source}: {e.message}") from None
            raise self.fail(sub, f"{shown}{e.message}{hint}") from None


_NOTHING = object()
_SCIENTIFIC = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _lookup(kwargs: dict, dotted: str) -> Any:
    value: Any = kwargs
    for part in dotted.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif dataclasses.is_dataclass(value) and hasattr(value, part):
            value = getattr(value, part)
        else:
            return _NOTHING
    return value


def load_mapping(cls: type, data: Any, source: str = "<config>", key: str = "") -> Any:
    """Build `cls` from an already parsed mapping; errors name `source` and the dotted key."""
    return _Loader(source).dataclass(cls, data, key)


def read_yaml(path: str | Path) -> Any:
    """Parse one YAML file (rlslurm/safeyaml.py's limits); every failure is a ConfigError with its place."""
    return read_file(path)


def to_dict(obj: Any) -> Any:
    """A plain mapping of a config object, for the resolved config written into a run directory."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj

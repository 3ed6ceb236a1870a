"""JSON from input that may be hostile (request bodies, data rows, responses files): bounded nesting and
integers, optionally no key twice and no NaN / Infinity; one error that says what, never a traceback.

    value = loads(raw)                           # JSONLimitError past a bound, json.JSONDecodeError if no JSON
    value = loads(raw, strict=True)              # a request body: a key twice or NaN is refused too

Python's json recurses once per level of nesting (100,000 `[` end in RecursionError: a 500 behind a server,
a traceback in the CLI), and an integer past the interpreter's 4,300-digit guard raises a bare ValueError
(the guard refuses by length, before converting, so it costs nothing). Both are JSONLimitError here, and the
depth is bounded well under the interpreter's recursion limit. Integers are parsed by json's own C code: a
Python hook per number made a 5 MB body of token ids five times slower to read.
"""

from __future__ import annotations

import json

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects (a chat row with tool calls is ~6 levels deep)."""
MAX_INT_DIGITS = 4300
"""Longest integer literal, in digits: the interpreter's own guard (sys.get_int_max_str_digits)."""


class JSONLimitError(ValueError):
    """JSON past one of this module's bounds, or (strict) a key given twice or a NaN / Infinity."""


def _unique(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise JSONLimitError(f"names {key[:64]!r} twice")
        seen[key] = value
    return seen


def _no_constant(name: str):
    raise JSONLimitError(f"holds {name}, which is not JSON")


def depth(value, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a parsed value (a scalar is 0), counted without recursion; stops past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in item if isinstance(child, dict | list))
    return deepest


def loads(raw: str | bytes, *, strict: bool = False, max_depth: int = MAX_DEPTH):
    """`raw` parsed; JSONLimitError past a bound (or, strict, a key twice or a NaN / Infinity);
    json.JSONDecodeError (also a ValueError) when it is no JSON; UnicodeDecodeError for bytes not UTF-8."""
    hooks = {"object_pairs_hook": _unique, "parse_constant": _no_constant} if strict else {}
    try:
        value = json.loads(raw, **hooks)
    except RecursionError:
        raise JSONLimitError(f"is nested deeper than {max_depth} levels of arrays and objects") from None
    except (json.JSONDecodeError, JSONLimitError, UnicodeDecodeError):
        raise
    except ValueError as e:  # int(): "Exceeds the limit (4300 digits) for integer string conversion ..."
        if "integer string conversion" not in str(e):
            raise
        raise JSONLimitError(f"holds an integer longer than {MAX_INT_DIGITS} digits") from None
    if depth(value, max_depth) > max_depth:
        raise JSONLimitError(f"is nested deeper than {max_depth} levels of arrays and objects")
    return value

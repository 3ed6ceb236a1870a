"""The built-in tools of rollout.tools: `calculator` (arithmetic, evaluated here, bounded) and `python` (the code
runs in the reward sandbox, rlslurm/reward/sandbox.py, and its stdout and stderr come back).

    calculate("123*45")        # "5535"; ToolError for anything but numbers, + - * / // % ** and parentheses

The calculator never calls eval: it walks the expression's syntax tree and refuses every node that is not a
number or one of those operators, and bounds what an expression can cost (its length, exponents, the size of
an integer), so a hostile expression ("9**9**9") is a tool error in microseconds, not a wedged controller.
"""

from __future__ import annotations

import ast
import math
import operator

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "The expression, e.g. 123*45"}},
        "required": ["expression"]}}}
PYTHON = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python program in a sandbox (no network, no files kept) and return what it printed.",
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "The program; print what you want to see."}},
        "required": ["code"]}}}
BUILTINS = {"calculator": CALCULATOR, "python": PYTHON}

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 100
"""An integer result (or operand) past this many digits is refused: 9**9**9 must not be computed."""
MAX_EXPONENT = 1000


class ToolError(Exception):
    """A built-in tool refused its arguments (the episode answers the model with the message)."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value):
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ToolError("the result is not a real number")
    if isinstance(value, int) and abs(value) >= 10 ** MAX_DIGITS:
        raise ToolError(f"a number past {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    return value


def _eval(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or
                                             abs(left) > 1 and abs(right) * math.log10(abs(left)) > MAX_DIGITS):
            raise ToolError(f"a power past {MAX_DIGITS} digits")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError) as e:
            raise ToolError(str(e)) from None
    raise ToolError(f"only numbers, + - * / // % ** and parentheses (not {type(node).__name__})")


def format_number(value) -> str:
    """An integer as is; a float without a trailing .0, to 12 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def calculate(expression: str) -> str:
    """The value of `expression` as text; ToolError naming what is not allowed."""
    if not isinstance(expression, str):
        raise ToolError("the expression must be text")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"an expression of at most {MAX_EXPRESSION_CHARS} characters")
    text = expression.replace("×", "*").replace("^", "**").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ToolError(f"not an arithmetic expression ({type(e).__name__})") from None
    return format_number(_eval(tree))


def python_output(status: str, stdout: bytes, stderr: bytes, reason: str,
                  cpu_limited: bool = False) -> tuple[str, str | None]:
    """(what the model is told, error kind or None) of one sandboxed run: a program that ran (or raised: its
    traceback is its output, as a notebook shows it) is no tool error; the sandbox's own verdicts are. A program
    the sandbox's CPU limit ended (`cpu_limited`) ran out of time as one past the wall clock does: `timeout`."""
    text = stdout.decode("utf-8", "replace")
    if stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + stderr.decode("utf-8", "replace")
    if status in ("ok", "failed"):
        return text, None
    if cpu_limited:
        return reason, "timeout"
    return reason, {"timeout": "timeout", "output_limit": "output_limit"}.get(status, "raised")

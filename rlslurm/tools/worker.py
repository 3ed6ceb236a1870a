"""One worker process of a user's tool (rollout.tools: `path/to/file.py:name`), the side the tool box's pool
talks to (rlslurm/reward/workers.py WorkerPool: processes killed when a call hangs, one JSON line each way).

    python -m rlslurm.tools.worker FILE.py:NAME     # started by rlslurm/tools/toolbox.py, never by hand but to debug

Requests: {"describe": true} -> {"schema": {...}} (the function's JSON schema: rlslurm/tools/schema.py, or the
module's `<name>_schema`), and {"arguments": {...}, "context": {...}} -> {"output": text} or {"error": kind,
"message": text}. The output is cut here to `max_chars` + 1 characters, so a tool that returns megabytes sends
a short line and is told apart (output_limit) by its length; what the tool prints goes to stderr, never into a
reply. `context` is the row's tools_kwargs for this tool (verl), passed to the keyword-only parameters the
function declares (all of it to a **kwargs).
"""

from __future__ import annotations

import inspect
import json
import sys

from rlslurm.reward.workers import serve_lines

MESSAGE_CHARS = 300


def load_tool(spec: str):
    """(the function, its schema) of FILE.py:NAME; an Exception naming the problem otherwise."""
    import importlib.util
    from pathlib import Path

    from rlslurm.tools.schema import function_schema

    path, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(f"rlslurm_tool_{Path(path).stem}", path)
    if module_spec is None or not Path(path).is_file():
        raise FileNotFoundError(f"{path} is not a Python file")
    sys.path.insert(0, str(Path(path).resolve().parent))  # modules beside it import as they would for the user
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))[:10]
        raise LookupError(f"{path} defines no function {name!r} (callables there: {found})")
    declared = getattr(module, f"{name}_schema", None)
    if declared is not None:
        if not isinstance(declared, dict):
            raise TypeError(f"{name}_schema in {path} must be a dict (a JSON schema)")
        schema = declared if "function" in declared else {"type": "function", "function": declared}
        schema["function"].setdefault("name", name)
    else:
        schema = function_schema(fn, name)
    return fn, schema


def _context_kwargs(fn, context: dict) -> dict:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return dict(context)
    return {k: v for k, v in context.items() if any(p.name == k and p.kind == p.KEYWORD_ONLY for p in params)}


def _call(fn, request: dict, max_chars: int) -> dict:
    arguments, context = request.get("arguments") or {}, request.get("context") or {}
    try:
        inspect.signature(fn).bind(**arguments, **_context_kwargs(fn, context))
    except TypeError as e:
        return {"error": "bad_arguments", "message": str(e)[:MESSAGE_CHARS]}
    try:
        value = fn(**arguments, **_context_kwargs(fn, context))
    except BaseException as e:  # SystemExit too: the call's failure, never the worker's
        return {"error": "raised", "message": f"{type(e).__name__}: {e}"[:MESSAGE_CHARS]}
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        try:
            value = json.dumps(value, default=str)
        except (TypeError, ValueError, RecursionError):
            value = str(value)
    return {"output": value[:max_chars + 1], "chars": len(value)}


def serve(argv: list[str]) -> None:
    """One worker: import the tool, say ready, then answer requests until stdin closes."""
    max_chars = int(argv[1]) if len(argv) > 1 else 4096

    def load():
        fn, schema = load_tool(argv[0])
        return lambda request: {"schema": schema} if request.get("describe") else _call(fn, request, max_chars)

    serve_lines(load, lambda e: {"error": "raised",
                                 "message": f"worker error {type(e).__name__}: {e}"[:MESSAGE_CHARS]})


if __name__ == "__main__":
    serve(sys.argv[1:])

"""One worker process of the reward service, the side workers.py's pool talks to: import the code (a user's reward
function, or math-verify), say ready, then answer one JSON line per request until stdin closes.

    python -m rlslurm.reward.worker --function FILE.py:NAME     # a user's verl-style compute_score
    python -m rlslurm.reward.worker --math                      # math-verify (the rule scorer, math_answers.py)

Started by `WorkerPool` (workers.py: why processes, the wire, the lifecycle), never by hand but to debug one.
"""

from __future__ import annotations

import sys
from typing import Any

from rlslurm.reward.workers import REASON_CHARS, serve_lines


def _score_of(value: Any, name: str) -> dict[str, Any]:
    """A reward function's return value as {"score", "reason"}: a finite number (bool and int too), or a dict
    holding one under "score" (its other keys go into the reason, as verl logs them); anything else is no
    score, and the reason says what came back."""
    import math
    import numbers

    extra = ""
    if isinstance(value, dict):
        if "score" not in value:
            return {"score": None, "reason": f"{name} returned a dict without 'score' (keys {sorted(value)[:8]})"}
        extra = ", ".join(f"{k}={v!r}" for k, v in value.items() if k != "score")
        value = value["score"]
    # numbers.Real covers bool, int, float and numpy's floats; __float__ numpy's bool_ and a 0-d tensor.
    try:
        if not isinstance(value, numbers.Real) and (isinstance(value, (str, bytes)) or not hasattr(value, "__float__")):
            raise TypeError
        score = float(value)
    except Exception:  # a user's object whose __float__ raises (a tensor of many elements): no number
        return {"score": None, "reason": f"{name} returned {type(value).__name__} {value!r:.80}, not a number"}
    if not math.isfinite(score):
        return {"score": None, "reason": f"{name} returned {score}, not a finite number"}
    return {"score": score, "reason": (f"{name}" + (f": {extra}" if extra else ""))[:REASON_CHARS]}


def _function_handler(spec: str):
    from rlslurm.reward.function import load_function

    fn, name = load_function(spec)

    def handle(request: dict) -> dict:
        # Trusted code: the user's own reward (as in verl), run as the service's uid with no sandbox; model
        # written code never comes here (reward.scorer: code runs it in the sandbox).
        try:
            value = fn(request["data_source"], request["solution_str"], request["ground_truth"],
                       extra_info=request["extra_info"])
        except BaseException as e:  # SystemExit too: one item's failure, never the worker's
            return {"score": None, "reason": f"{name} raised {type(e).__name__}: {e}"[:REASON_CHARS]}
        return _score_of(value, name)

    return handle


def _math_handler():
    from rlslurm.reward.math_answers import verify_scored

    def handle(request: dict) -> dict:
        scored = verify_scored(request["response"], request["reference"], timeout_s=request.get("timeout_s", 5))
        return {"score": scored.score, "reason": scored.reason[:REASON_CHARS]}

    return handle


def serve(argv: list[str]) -> None:
    """One worker: import, say ready, then answer requests until stdin closes."""
    serve_lines(lambda: _function_handler(argv[1]) if argv[0] == "--function" else _math_handler(),
                lambda e: {"score": None, "reason": f"worker error {type(e).__name__}: {e}"[:REASON_CHARS]})


if __name__ == "__main__":
    serve(sys.argv[1:])

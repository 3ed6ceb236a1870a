"""The job's generation bounds on a request body, by value whatever its JSON type: what vLLM's gate
(rollout/vllm_serve.py SecretGate) checks before vLLM parses a body, and the rule the transformers engine's
schema (rollout/schema.py `Count`) applies to the same fields.

    problem = Bounds(max_n=8, max_tokens=64).check(body_bytes, shape="completion")   # None, or the 400's message

Why by value: vLLM (pydantic, lax) turns `"n": 100.0`, `"n": "100"`, `"n": " 100 "` and `"n": true` into
integers, so a check of `isinstance(n, int)` let 16,384 choices through (issue 29). The rule here:

- a count is a JSON integer, or a float with no fractional part (8.0 is 8); within its range it is accepted;
- a string, a bool, a fraction, NaN / Infinity (Python's json reads those literals) is refused, in range or not:
  a count is a number, and a value the gate does not read as vLLM would is a way around it;
- over or under its range is refused, whatever the type (1e300, 10**30, -1);
- a body with a key twice is refused (which copy a parser keeps is its own choice);
- `logprobs` alone may also be a bool in a chat body (chat's on/off switch; top_logprobs is its count);
- a body vLLM may serve as either kind (/invocations) is bounded as both: a chat body's one prompt and, read
  as a completion, every prompt of its `prompt` and `prompt_embeds` (issue 37: `"messages": "x"` beside 1,024
  prompts passed as one chat prompt, and vLLM's completion fallback returned 16,384 choices);
- a body nested past safejson.MAX_DEPTH or with an integer past its digits is refused, not handed to vLLM.

Fields: n and best_of <= max_n; max_tokens, max_completion_tokens, max_output_tokens and min_tokens <= max_tokens;
logprobs, top_logprobs, prompt_logprobs <= MAX_LOGPROBS (vLLM reads -1 as "the whole vocabulary"); prompts per
request <= max_prompts; prompts x n <= max_batch_rows. A chat body must name its max_tokens (vLLM's default is
the rest of the context); a completion's default is 16 (OpenAI's and vLLM's).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from rlslurm import safejson

MAX_LOGPROBS = 20
"""Top log-probabilities a request may ask per token (the transformers engine's schema says the same)."""

COUNTS = {"n": "max_n", "best_of": "max_n", "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
          "max_output_tokens": "max_tokens", "min_tokens": "max_tokens", "logprobs": "max_logprobs",
          "top_logprobs": "max_logprobs", "prompt_logprobs": "max_logprobs"}
"""Each bounded field, and the Bounds attribute that is its upper limit."""
FLOOR = {"n": 1, "best_of": 1, "max_tokens": 1, "max_completion_tokens": 1, "max_output_tokens": 1}
"""Lower limits (0 for the rest)."""
CONFIG_KEY = {"max_n": "rollout.max_n", "max_tokens": "rollout.max_new_tokens", "max_logprobs": "bounds.MAX_LOGPROBS",
              "max_prompts": "rollout.max_prompts_per_request", "max_batch_rows": "rollout.max_batch_rows"}


class BoundError(ValueError):
    """A body or field past the job's bounds; the message is the 400's."""


def as_count(value, name: str = "") -> int | None:
    """`value` of count field `name` as an int (None stays None); BoundError if it is not a whole number."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise BoundError(f"{name or 'a count'} = {json.dumps(value)} must be a whole number, not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise BoundError(f"{name or 'a count'} = {value!r} must be a whole number")
        return int(value)
    kind = "a string" if isinstance(value, str) else f"a JSON {type(value).__name__}"
    raise BoundError(f"{name or 'a count'} must be a whole number, not {kind}")


def parse(body: bytes):
    """The JSON of a body (rlslurm/safejson.py, strict): BoundError for a key given twice, NaN / Infinity, nesting
    past safejson.MAX_DEPTH or an integer past its digits; ValueError when it is no JSON at all."""
    try:
        return safejson.loads(body, strict=True)
    except safejson.JSONLimitError as e:
        raise BoundError(f"the body {e}") from None


def prompts_of(prompt) -> int:
    """How many prompts a completions `prompt` holds: one string or one list of token ids is one; any other list
    (strings, lists of ids, objects) holds one per item, whatever vLLM makes of each."""
    if not isinstance(prompt, list) or not prompt:
        return 1
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return 1
    return len(prompt)


def completion_prompts(request: dict) -> int:
    """Prompts a body is served as when vLLM reads it as a completion: its `prompt`'s, plus one per item of
    `prompt_embeds` (vLLM takes both lists); at least one."""
    embeds = request.get("prompt_embeds")
    embedded = len(embeds) if isinstance(embeds, list) else int(embeds is not None)
    prompts = prompts_of(request["prompt"]) if "prompt" in request else 0
    return max(1, prompts + embedded)


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """What one request may ask of an engine: the job's rollout.* limits (rollout/server.py's flags)."""

    max_n: int = 64
    """Samples per prompt (n, best_of)."""
    max_tokens: int = 4096
    """Tokens per sample (max_tokens, max_completion_tokens, min_tokens)."""
    max_prompts: int = 1024
    """Prompts per request."""
    max_batch_rows: int = 1 << 20
    """Prompts x n of one request."""
    max_logprobs: int = MAX_LOGPROBS
    """Top log-probabilities per token (logprobs, top_logprobs, prompt_logprobs)."""

    def check(self, body: bytes, shape: str) -> str | None:
        """Why a body of `shape` (completion, chat, tokenize, or any: /invocations' body is either kind) is
        refused, or None. A body that is no JSON at all is left to vLLM's own validation (it refuses it); one
        past safejson's depth or digits is refused here (vLLM's own parser answered 100,000 `[` with a 500).

        `any` is bounded as every kind it may be served as: vLLM's /invocations tries the body as a chat
        request first and, when that fails validation (say `"messages": "x"`), serves it as a completion
        (vllm/entrypoints/serve/sagemaker/api_router.py), so it must pass both checks."""
        try:
            request = parse(body)
        except BoundError as e:
            return str(e)
        except ValueError:
            return None
        if not isinstance(request, dict):
            return None
        shapes = {"any": ("chat", "completion") if "messages" in request else ("completion",)}.get(shape, (shape,))
        try:
            return next((problem for kind in shapes if (problem := self._check(request, kind))), None)
        except BoundError as e:
            return str(e)

    def _check(self, request: dict, shape: str) -> str | None:
        chat = shape == "chat"
        # A chat body's logprobs is a switch; read as a completion (/invocations' fallback) vLLM takes it as 0 or 1.
        switch = "messages" in request and shape in ("chat", "completion") and isinstance(request.get("logprobs"), bool)
        values = {name: as_count(request.get(name), name) for name in COUNTS if not (switch and name == "logprobs")}
        for name, value in values.items():
            if value is None:
                continue
            limit = getattr(self, COUNTS[name])
            if not FLOOR.get(name, 0) <= value <= limit:
                return (f"{name} = {value} is outside [{FLOOR.get(name, 0)}, {limit}], this engine's limit "
                        f"({CONFIG_KEY[COUNTS[name]]})")
        if chat:
            if values["max_tokens"] is None and values["max_completion_tokens"] is None:
                return (f"a chat request must set max_tokens (at most {self.max_tokens}, rollout.max_new_tokens): "
                        "vLLM's default is the rest of the model's context")
            prompts = 1
        else:
            prompts = completion_prompts(request)
        if prompts > self.max_prompts:
            return (f"{prompts} prompts are over this engine's limit of {self.max_prompts} "
                    "(rollout.max_prompts_per_request)")
        n = max(values["n"] or 1, values["best_of"] or 1)
        if prompts * n > self.max_batch_rows:
            return (f"{prompts} prompts x n = {n} = {prompts * n} sequences are over this engine's limit of "
                    f"{self.max_batch_rows} (rollout.max_batch_rows)")
        return None

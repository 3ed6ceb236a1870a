"""One table of hostile generation parameters (issue 29), posted to both engines: the transformers engine
(test_engine_trust.py) and vLLM's server behind rlslurm's gate (tests/vllm/test_vllm_bounds.py), on every route
that generates. Both are started with LIMITS: n <= 4, max_tokens <= 64, 3 prompts, 8 sequences per request.

Each case is a JSON fragment (text, so NaN, Infinity and a key given twice can be written) and a word the 400's
message must hold. The rule (rlslurm/rollout/bounds.py): a count is a JSON integer or an integral float within
its range; a string, a bool, a fraction or NaN / Infinity is refused even in range; past its range, refused
whatever its type."""

from __future__ import annotations

LIMITS = {"max_n": 4, "max_tokens": 64, "max_prompts": 3, "max_batch_rows": 8}
SERVER_FLAGS = ("--max-n", "4", "--max-tokens", "64", "--max-prompts", "3", "--max-batch-rows", "8")

HOSTILE = [
    ('"n": 100', "n"),
    ('"n": 100.0', "n"),
    ('"n": 16384.0', "n"),
    ('"n": "100"', "n"),
    ('"n": " 100 "', "n"),
    ('"n": "2"', "n"),
    ('"n": true', "n"),
    ('"n": 2.5', "n"),
    ('"n": 1e300', "n"),
    ('"n": 1000000000000000000000000000000', "n"),
    ('"n": -1', "n"),
    ('"n": 0', "n"),
    ('"n": NaN', "n"),
    ('"n": Infinity', "n"),
    ('"n": -Infinity', "n"),
    ('"n": 1, "n": 100', "n"),
    ('"max_tokens": 100.0', "max_tokens"),
    ('"max_tokens": "100"', "max_tokens"),
    ('"max_tokens": 100', "max_tokens"),
    ('"max_tokens": -5', "max_tokens"),
    ('"max_tokens": 1e400', "max_tokens"),
    ('"max_tokens": false', "max_tokens"),
    ('"max_tokens": 8, "min_tokens": 100', "min_tokens"),
    ('"max_tokens": 8, "min_tokens": "100"', "min_tokens"),
    ('"max_tokens": 8, "max_completion_tokens": 100.0', "max_completion_tokens"),
    ('"best_of": 100', "best_of"),
    ('"best_of": "16"', "best_of"),
    ('"logprobs": 100', "logprobs"),
    ('"logprobs": -1', "logprobs"),
    ('"logprobs": "5"', "logprobs"),
    ('"top_logprobs": 100', "top_logprobs"),
    ('"prompt_logprobs": -1', "prompt_logprobs"),
    ('"prompt_logprobs": 100.0', "prompt_logprobs"),
    ('"prompt": ["a", "b", "c", "d"]', "prompts"),
    ('"prompt": ["a", "b", "c"], "n": 3', "sequences"),
    ('"prompt": [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}, {"prompt_token_ids": [3]}, '
     '{"prompt_token_ids": [4]}]', "prompt"),
]


def body(fragment: str) -> bytes:
    """A completions body around `fragment` (its own prompt unless the fragment names one)."""
    prompt = "" if '"prompt"' in fragment else ', "prompt": "abc"'
    return ('{"model": "policy", ' + fragment + prompt + "}").encode()


def chat_body(fragment: str) -> bytes:
    """A chat body around `fragment` (with max_tokens 8 unless the fragment names one)."""
    tokens = "" if "max_tokens" in fragment else ', "max_tokens": 8'
    return ('{"model": "policy", "messages": [{"role": "user", "content": "abc"}], ' + fragment + tokens
            + "}").encode()

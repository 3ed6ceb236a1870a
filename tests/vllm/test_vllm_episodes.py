"""vLLM's own server in multi-turn episodes (rollout.engine: vllm): the prompts of every turn go as token ids, the
episode is the engine's token ids, and the trainer's log-prob of every generated token equals vLLM's; the tool's
tokens and the template's are masked out of the loss (tests/integration/test_episode_logprobs.py: the same on
rlslurm's transformers server)."""

from __future__ import annotations

import pytest

from episode_checks import TWICE, check_twice
from tool_fixtures import scripted_model
from vllm_fixtures import start_vllm_serve


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # hidden 128, 4 heads: head size 32, the smallest vLLM's CPU attention takes
    return scripted_model(tmp_path_factory.mktemp("scripted") / "m", TWICE, hidden=128)


def test_an_episode_calling_a_tool_twice_is_the_trainers_token_for_token_on_vllm(model_dir, vllm_python, tmp_path):
    proc = start_vllm_serve(model_dir, tmp_path, vllm_python, limits={"max_n": 4, "max_tokens": 128})
    try:
        figures = check_twice(proc.client, model_dir)
    finally:
        proc.stop(timeout_s=30)
    print(f"FIGURE vllm_episode_logprobs: {figures}")

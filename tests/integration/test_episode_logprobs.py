"""rlslurm's transformers engine server in multi-turn episodes: an episode that calls a tool twice is kept as the
engine's token ids, and the trainer's log-prob of every generated token equals the engine's; the tool's tokens
and the template's are masked out of the loss (tests/vllm/test_vllm_episodes.py: the same on vLLM's server)."""

from __future__ import annotations

import pytest

from episode_checks import TWICE, check_twice
from rollout_fixtures import start_engine
from tool_fixtures import scripted_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return scripted_model(tmp_path_factory.mktemp("scripted") / "m", TWICE)


def test_an_episode_calling_a_tool_twice_is_the_trainers_token_for_token(model_dir, tmp_path):
    proc = start_engine(model_dir, tmp_path)
    try:
        figures = check_twice(proc.client, model_dir)
    finally:
        proc.stop()
    print(f"FIGURE hf_episode_logprobs: {figures}")

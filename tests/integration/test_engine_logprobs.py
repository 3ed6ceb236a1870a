"""The HF engine's log-probabilities are the trainer's: each generated token's log-softmax at temperature 1,
teacher-forced by the same model, whatever the sampling temperature; and they are kept per step, not as every
step's logits (rollout/engine.py: _ChosenLogprobs; output_logits OOM-killed a SmolLM2 HumanEval evaluation)."""

from __future__ import annotations

import pytest
import torch

from rlslurm.rollout.engine import HFEngine, SamplingParams
from rollout_fixtures import PROMPTS, save_model, tiny_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(save_model(tiny_llama(3), tmp_path_factory.mktemp("tiny"), eos=False))


def teacher_forced(engine: HFEngine, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_every_tokens_logprob_is_the_models_at_temperature_one(engine, temperature):
    out = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=12, n=2, seed=5))
    assert [len(per_prompt) for per_prompt in out] == [2] * len(PROMPTS)
    for per_prompt in out:
        for c in per_prompt:
            assert len(c.token_ids) == len(c.logprobs) == 12  # no end-of-sequence token: every sample is long
            want = teacher_forced(engine, c.prompt_token_ids, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=1e-4)

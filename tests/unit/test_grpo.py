"""GRPO's pieces (rlslurm/rl/experience.py, rlslurm/rl/policy.py): group advantages, the samples they are
attached to, and one real update.

    python -m pytest -q tests/unit/test_grpo.py      # ~5 s on 2 cores

The update test trains the embedded tiny Llama (random init, saved and reloaded as an HF directory, the
way an RL job gets it) on a fixed batch and measures log-probabilities before and after.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

from rlslurm.errors import RlslurmError
from rlslurm.rl.experience import Sample, build_samples, group_advantages
from rlslurm.rl.policy import Policy
from rlslurm.tasks.arithmetic import Problem
from rlslurm.tokenizer import EOS_ID, VOCAB, build_tokenizer


def test_advantages_are_rewards_normalised_within_the_group():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert statistics.pstdev(adv) == pytest.approx(1.0, abs=1e-5)
    # one right of four: it gets +sqrt(3), each wrong one -1/sqrt(3)
    assert adv[0] == pytest.approx(math.sqrt(3), rel=1e-5)
    assert adv[1:] == pytest.approx([-1 / math.sqrt(3)] * 3, rel=1e-5)


@pytest.mark.parametrize("rewards", [[0.0] * 8, [1.0] * 8, [0.5, 0.5]])
def test_a_group_with_equal_rewards_has_no_advantage(rewards):
    assert group_advantages(rewards) is None


def _choice(tokens: list[int], version: int = 3) -> dict:
    return {"token_ids": tokens, "token_logprobs": [-0.5] * len(tokens), "policy_version": version}


def test_samples_keep_prompt_order_and_zero_variance_groups_are_dropped():
    problems = [Problem(1, "+", 2), Problem(5, "-", 3), Problem(4, "+", 4)]
    k = 4
    # response j of prompt g is the single token 4 + 4g + j: where each one lands is visible
    choices = [_choice([4 + 4 * g + j]) for g in range(3) for j in range(k)]
    rewards = [0.0, 1.0, 0.0, 1.0,   # mixed: kept
               0.0, 0.0, 0.0, 0.0,   # all wrong: dropped
               1.0, 0.0, 0.0, 0.0]   # mixed: kept
    tok = build_tokenizer()
    samples, dropped = build_samples(problems, choices, rewards, k, lambda t: tok(t)["input_ids"])
    assert dropped == 1
    assert [s.response_ids[0] for s in samples] == [4, 5, 6, 7, 12, 13, 14, 15]
    assert [s.prompt_ids for s in samples[:4]] == [tok("1+2=")["input_ids"]] * 4
    assert [s.prompt_ids for s in samples[4:]] == [tok("4+4=")["input_ids"]] * 4
    assert [s.reward for s in samples] == rewards[:4] + rewards[8:]
    assert all((s.advantage > 0) == (s.reward == 1.0) for s in samples)
    assert {s.version for s in samples} == {3}


def test_responses_dropped_by_the_reward_policy_leave_their_group():
    """reward.degrade: drop gives None: the group is normalised over the rest; one left is no group."""
    problems = [Problem(1, "+", 2), Problem(5, "-", 3)]
    choices = [_choice([4 + 4 * g + j]) for g in range(2) for j in range(4)]
    rewards = [1.0, None, 0.0, None,   # two left, mixed: kept as a group of two
               1.0, None, None, None]  # one left: nothing to compare it with
    samples, dropped = build_samples(problems, choices, rewards, 4, lambda t: [1])
    assert dropped == 1
    assert [s.response_ids[0] for s in samples] == [4, 6]
    assert [s.advantage for s in samples] == pytest.approx(group_advantages([1.0, 0.0]))


def test_a_rollout_that_lost_responses_is_refused():
    problems = [Problem(1, "+", 2), Problem(2, "+", 2)]
    with pytest.raises(RlslurmError, match="lost or duplicated"):
        build_samples(problems, [_choice([5])] * 7, [0.0] * 7, 4, lambda t: [1])


def _encode_answer(text: str) -> list[int]:
    return [VOCAB[ch] for ch in text] + [EOS_ID]


def _batch() -> list[Sample]:
    """Eight prompts, each with its right answer and three wrong ones (k = 4), as GRPO would score them."""
    tok = build_tokenizer()
    samples = []
    for a, b in [(12, 7), (30, 41), (55, 5), (9, 9), (70, 13), (23, 48), (61, 2), (44, 44)]:
        problem = Problem(a, "+", b)
        answers = [problem.target] + [str(problem.answer + d) for d in (1, -10, 7)]
        rewards = [1.0, 0.0, 0.0, 0.0]
        for answer, reward, adv in zip(answers, rewards, group_advantages(rewards)):
            response = _encode_answer(answer)
            samples.append(Sample(list(tok(problem.prompt)["input_ids"]), response, reward, adv, 0,
                                  [0.0] * len(response)))
    return samples


def _mean_logprobs(policy: Policy, samples: list[Sample]) -> torch.Tensor:
    """Per sample: mean log-probability of its response tokens under the policy now."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            lp = Policy._logprobs(policy.model, ids, torch.ones_like(ids))[0, len(s.prompt_ids) - 1:]
            out.append(lp.mean())
    return torch.stack(out)


def test_one_update_raises_the_right_answers_and_lowers_the_wrong_ones(policy_and_guard):
    policy, guard = policy_and_guard
    samples = _batch()
    positive = torch.tensor([s.advantage > 0 for s in samples])
    before = _mean_logprobs(policy, samples)
    stats = policy.update(samples, guard)
    delta = _mean_logprobs(policy, samples) - before
    assert stats["tokens"] == sum(len(s.response_ids) for s in samples)
    assert stats["grad_norm"] > 0 and math.isfinite(stats["loss"])
    assert delta[positive].mean() > 0, delta
    assert delta[~positive].mean() < 0, delta
    # the objective the loss ascends: sum of advantage x mean log-prob over the batch
    adv = torch.tensor([s.advantage for s in samples])
    assert (adv * delta).sum() > 0


def test_with_kl_the_reference_stays_frozen_and_the_penalty_is_reported(policy_and_guard, tmp_path):
    policy, guard = policy_and_guard
    job = dataclasses.replace(policy.job, rl=dataclasses.replace(policy.job.rl, kl_coef=0.1))
    with_kl = Policy(job, policy.topo, tmp_path / "init")
    reference = {k: v.clone() for k, v in with_kl.reference.state_dict().items()}
    samples = _batch()
    first = with_kl.update(samples, guard)
    second = with_kl.update(samples, guard)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step
    assert second["kl"] > 0
    assert all(torch.equal(v, with_kl.reference.state_dict()[k]) for k, v in reference.items())

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
from rlslurm.logprobs import CausalLMScorer
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
            lp = CausalLMScorer(policy.model, fused=False)(ids, torch.ones_like(ids))[0, len(s.prompt_ids) - 1:]
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


def _forwards(policy: Policy) -> dict:
    """Counts the model's forward passes, with and without grad, from now on."""
    seen = {"grad": 0, "no_grad": 0}

    def hook(module, args, output):
        seen["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    policy.model.register_forward_hook(hook)
    return seen


def _with_engine_logprobs(samples: list[Sample], stale: bool) -> list[Sample]:
    """Half the samples stale (behaviour = the engine's: made-up log-probs here), every one with engine log-probs."""
    return [dataclasses.replace(s, engine_logprobs=[-0.5 - 0.1 * j for j in range(len(s.response_ids))],
                                staleness=int(stale and i % 2)) for i, s in enumerate(samples)]


@pytest.mark.parametrize("stale", [False, True])
def test_one_mini_batch_takes_its_behaviour_log_probs_from_the_training_forward(policy_and_guard, tmp_path, stale,
                                                                                 monkeypatch):
    """rl.mini_batches = 1: one forward per micro-batch, with grad (no separate behaviour forward, TRL's
    `old = new.detach()`), and the very update, loss and diagnostics the separate no-grad forward gave."""
    import rlslurm.rl.policy as policy_module

    policy, guard = policy_and_guard
    job = dataclasses.replace(policy.job, parallel=dataclasses.replace(policy.job.parallel, micro_batch_size=12))
    samples = _with_engine_logprobs(_batch(), stale)  # 32 samples: micro-batches of 12, 12 and 8
    fused, separate = (Policy(job, policy.topo, tmp_path / "init") for _ in range(2))
    counted = _forwards(fused)
    got = fused.update(samples, guard)
    assert counted == {"grad": 3, "no_grad": 0}
    monkeypatch.setattr(policy_module, "behaviour_forward", lambda mini_batches: True)  # the old way
    counted = _forwards(separate)
    want = separate.update(samples, guard)
    assert counted == {"grad": 3, "no_grad": 3}
    for key in ("loss", "tokens", "grad_norm", "clip_fraction", "engine_trainer_logprob_gap", "stale_logprob_drift"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert (got["stale_logprob_drift"] > 0) == stale and got["engine_trainer_logprob_gap"] > 0
    for a, b in zip(fused.model.parameters(), separate.model.parameters()):
        assert torch.allclose(a, b, atol=1e-7)


def test_two_mini_batches_keep_the_behaviour_forward_and_the_plan_counts_what_runs(policy_and_guard, tmp_path):
    """rl.mini_batches = 2: the behaviour log-probs come from a no-grad forward before the first step (the second
    mini-batch's ratio is against them); the plan's train step counts that forward exactly when it runs."""
    from rlslurm.modelspec import param_counts
    from rlslurm.plan.compute import device_speed, train_seconds

    policy, guard = policy_and_guard
    base = dataclasses.replace(policy.job, parallel=dataclasses.replace(policy.job.parallel, micro_batch_size=8))
    for mini, forwards in ((1, {"grad": 4, "no_grad": 0}), (2, {"grad": 4, "no_grad": 4})):
        job = dataclasses.replace(base, rl=dataclasses.replace(base.rl, mini_batches=mini))
        trained = Policy(job, policy.topo, tmp_path / "init")
        counted = _forwards(trained)
        assert trained.update(_batch(), guard)["mini_batches"] == mini
        assert counted == forwards
        planned = train_seconds(job, param_counts(job.model), 1, device_speed(job.hardware, job.timing.mfu))
        assert ("behaviour forward" in planned.how) == (counted["no_grad"] > 0), planned.how


def test_the_engine_trainer_gap_is_the_largest_difference_at_each_fresh_samples_own_positions():
    """UpdateStats.observe (vectorised): the largest |trainer - engine| log-prob over the response positions of the
    fresh samples only, each at its own offset (prompts and responses of different lengths), as one sample at a
    time computes it."""
    from rlslurm.rl.objective import UpdateStats, behaviour_logprobs, pack

    rng = torch.Generator().manual_seed(0)
    samples = []
    for i in range(9):
        prompt = [1] + [4 + (i + j) % 10 for j in range(3 + i % 3)]
        response = [5 + j for j in range(1 + i % 4)] + [EOS_ID]
        engine = torch.randn(len(response), generator=rng).tolist()
        samples.append(Sample(prompt, response, 0.0, 1.0, 0, engine if i != 4 else [], staleness=int(i % 3 == 2)))
    batch = pack(samples, 0)
    old = torch.randn(batch.mask.shape, generator=rng)
    stats = UpdateStats()
    stats.observe(samples, batch, old, behaviour_logprobs(batch, old))
    want = 0.0
    for i, s in enumerate(samples):
        if s.staleness == 0 and s.engine_logprobs:
            start = len(s.prompt_ids) - 1
            trainer = old[i, start: start + len(s.engine_logprobs)]
            want = max(want, float((trainer - torch.tensor(s.engine_logprobs)).abs().max()))
    assert stats.gap == pytest.approx(want) and want > 0
    assert stats.tokens == sum(len(s.response_ids) for s in samples)

"""The GRPO family's switches (rl.loss_agg, clip_eps_low/high, ratio, baseline, overlong, tis_cap), each on
hand-built tensors against the formula in its paper, written here as plain per-token Python loops, and
against TRL's own GRPO loss (trl 1.16, the dev extra) on the same tensors.

    python -m pytest -q tests/unit/test_rl_objectives.py      # ~15 s on 2 cores (TRL's import is most of it)

TRL's loss is `GRPOTrainer._compute_loss`, a method that reads its settings from the trainer and the model's
log-probs from `_get_per_token_logps_and_entropies`: it is called here unbound, on a stand-in `self` that
holds those settings and hands back our tensors, so TRL's own aggregation, clipping, sequence-level ratio and
importance-sampling product run as TRL ships them. Two pieces of TRL sit inline in the trainer's rollout
method and cannot be called alone, so they are re-derived from its source (trl/trainer/grpo_trainer.py
1.16): the vLLM importance-sampling ratio of mode token_truncate, clamp(exp(old - sampling), max=C), and the
advantages (group mean and Bessel-corrected std, + 1e-4; RLOO's in rloo_trainer.py: (sum - r) / (k - 1)).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlslurm.rl.experience import Advantages, group_samples
from rlslurm.rl.objective import Objective, Packed, divisors

# Four responses of 5, 2, 4 and 3 tokens (in a width of 6, so the padding shows), advantages of both signs.
LENGTHS = [5, 2, 4, 3]
ADV = [1.3, -0.7, 0.4, -1.1]
WIDTH = 6


def _batch(stale: list[bool] | None = None) -> tuple[Packed, torch.Tensor, torch.Tensor]:
    """(batch, new log-probs (a leaf that takes a gradient), behaviour log-probs): new moved off behaviour by up
    to +-0.5 per token so that both clip bounds bite; engine log-probs off the behaviour by up to +-1.5."""
    g = torch.Generator().manual_seed(7)
    n = len(LENGTHS)
    mask = torch.zeros(n, WIDTH)
    for i, length in enumerate(LENGTHS):
        mask[i, :length] = 1.0
    behaviour = -torch.rand(n, WIDTH, generator=g) * 2 - 0.1
    noise = torch.rand(n, WIDTH, generator=g) - 0.5
    engine = (behaviour + (torch.rand(n, WIDTH, generator=g) - 0.5) * 3) * mask
    stale_t = torch.tensor([[1.0 if stale and stale[i] else 0.0] for i in range(n)])
    # a stale sample's behaviour log-probs are the engine's (rlslurm/rl/objective.py's behaviour_logprobs)
    behaviour = torch.where(stale_t.bool() & (mask > 0), engine, behaviour)
    new = (behaviour + noise).requires_grad_(True)
    tokens = torch.zeros(n, WIDTH, dtype=torch.long)
    batch = Packed(tokens, tokens, mask, torch.tensor(ADV)[:, None], engine, stale_t,
                   torch.tensor(LENGTHS), n)
    return batch, new, behaviour


def _paper_loss(obj: Objective, new, behaviour, batch) -> float:
    """The objective as the papers write it, token by token, negated (the loss)."""
    n, new = len(LENGTHS), new.detach()
    per_seq, total, tokens = [], 0.0, 0
    for i in range(n):
        L = LENGTHS[i]
        lr = [float(new[i, t] - behaviour[i, t]) for t in range(L)]
        if obj.ratio == "sequence":  # GSPO eq. 7: s_i = (pi / pi_old) ** (1 / |y|), one per response
            s = math.exp(sum(lr) / L)
            ratios = [s] * L
        else:
            ratios = [math.exp(x) for x in lr]
        terms = []
        for t in range(L):
            r, a = ratios[t], ADV[i]
            clipped = min(max(r, 1 - obj.clip_low), 1 + obj.clip_high)
            term = min(r * a, clipped * a)
            if obj.tis_cap is not None and not float(batch.stale[i, 0]):  # TIS: min(pi_old / pi_rollout, C)
                term *= min(math.exp(float(behaviour[i, t]) - float(batch.engine_logprobs[i, t])), obj.tis_cap)
            terms.append(term)
        per_seq.append(terms)
        total += sum(terms)
        tokens += L
    if obj.loss_agg == "token_mean":  # DAPO eq. 10: 1 / sum |o_i| * sum_i sum_t
        return -total / tokens
    if obj.loss_agg == "seq_sum_norm":  # Dr. GRPO: sum_t over a constant, then the mean over responses
        return -sum(sum(t) / obj.norm_tokens for t in per_seq) / n
    return -sum(sum(t) / len(t) for t in per_seq) / n  # GRPO eq. 3: 1 / G sum_i 1 / |o_i| sum_t


SWITCHES = {
    "grpo": Objective(),
    "clip_higher": Objective(clip_low=0.2, clip_high=0.28),
    "token_mean": Objective(clip_low=0.2, clip_high=0.28, loss_agg="token_mean"),
    "seq_sum_norm": Objective(loss_agg="seq_sum_norm", norm_tokens=8),
    "gspo": Objective(clip_low=0.03, clip_high=0.04, ratio="sequence"),
    "tis": Objective(tis_cap=2.0),
    "dapo_tis": Objective(clip_low=0.2, clip_high=0.28, loss_agg="token_mean", tis_cap=1.5),
}


def _divisor(obj: Objective) -> float:
    return float(sum(LENGTHS)) if obj.per_token else float(len(LENGTHS))


@pytest.mark.parametrize("name", list(SWITCHES))
def test_each_switch_is_its_papers_formula(name):
    obj = SWITCHES[name]
    batch, new, behaviour = _batch(stale=[False, True, False, False])
    ours = obj.loss(new, behaviour, batch, _divisor(obj))
    assert float(ours.detach()) == pytest.approx(_paper_loss(obj, new, behaviour, batch), abs=1e-6)
    if name != "grpo":  # each switch changes the loss of these tensors: the test can tell them apart
        assert abs(float(ours.detach()) - float(SWITCHES["grpo"].loss(new, behaviour, batch, 4.0).detach())) > 1e-4


def test_the_clip_bounds_are_the_ones_set():
    batch, new, behaviour = _batch()
    obj = SWITCHES["clip_higher"]
    ratio = torch.exp(new - behaviour).detach()
    outside = (((ratio < 0.8) | (ratio > 1.28)).float() * batch.mask).sum()
    assert obj.clipped(new, behaviour, batch) == float(outside) > 0
    symmetric = (((ratio < 0.8) | (ratio > 1.2)).float() * batch.mask).sum()
    assert Objective().clipped(new, behaviour, batch) == float(symmetric)


def test_gspo_gradient_is_the_sequence_weight_times_the_mean_token_gradient():
    """GSPO eq. 10: within the clip, grad J = 1 / G sum_i s_i A_i (1 / |y_i|) sum_t grad log pi(y_i,t)."""
    obj = Objective(clip_low=10.0 - 9.99, clip_high=10.0, ratio="sequence")  # wide: nothing is clipped above
    batch, new, behaviour = _batch()
    obj.loss(new, behaviour, batch, 4.0).backward()
    for i, L in enumerate(LENGTHS):
        s = math.exp(float((new.detach()[i, :L] - behaviour[i, :L]).sum()) / L)
        if s < 1 - obj.clip_low and ADV[i] < 0:
            continue
        expected = -s * ADV[i] / L / 4
        assert new.grad[i, :L].tolist() == pytest.approx([expected] * L, rel=1e-5)
        assert new.grad[i, L:].abs().sum() == 0


def test_tis_weighs_fresh_tokens_only_and_caps_them():
    batch, new, behaviour = _batch(stale=[False, True, False, False])
    w = Objective(tis_cap=2.0).tis_weights(behaviour, batch)
    raw = torch.exp(behaviour - batch.engine_logprobs)
    mask = batch.mask > 0
    assert float(w[mask].max()) == 2.0 and float(raw[mask].max()) > 2.0  # the cap bites
    assert torch.equal(w[0][:5], raw[0][:5].clamp(max=2.0))
    assert w[1, :2].tolist() == [1.0, 1.0]  # a stale sample's ratio is already against the engine's


def test_token_mean_micro_batches_add_up_to_the_mini_batch_with_the_counted_divisor():
    obj = SWITCHES["token_mean"]
    batch, new, behaviour = _batch()
    whole = float(obj.loss(new, behaviour, batch, float(sum(LENGTHS))))
    part = SimpleNamespace(total=4, samples=[SimpleNamespace(response_ids=[0] * n) for n in LENGTHS])
    (divisor,) = divisors(obj, [part], 1)
    assert divisor == sum(LENGTHS)
    split = sum(float(obj.loss(new[a:b], behaviour[a:b], batch.rows(a, b), divisor)) for a, b in [(0, 1), (1, 4)])
    assert split == pytest.approx(whole, abs=1e-7)
    # two data-parallel ranks, each holding half: the all-reduce sums their tokens, DDP averages gradients
    halves = [SimpleNamespace(total=4, samples=part.samples[:2]), SimpleNamespace(total=4, samples=part.samples[2:])]
    reduced = divisors(obj, [halves[0]], 2, reduce=lambda t: t.add_(torch.tensor([float(sum(LENGTHS[2:]))],
                                                                                 dtype=torch.float64)))
    assert reduced == [sum(LENGTHS) / 2]


# -- TRL's loss on the same tensors -------------------------------------------------------------------------

def _trl_grpo_trainer():
    """TRL's GRPOTrainer class. TRL asks at import whether vLLM is installed and parses its version; under pytest
    tests/vllm is on sys.path, a namespace package named `vllm` with no version, which TRL's check cannot parse:
    it is told there is no vLLM (there is none in this venv; the vLLM engine has its own, .venv-vllm)."""
    import importlib

    importlib.import_module("trl.import_utils").is_vllm_available = lambda *args, **kwargs: False
    from trl.trainer.grpo_trainer import GRPOTrainer

    return GRPOTrainer


def _trl_loss(obj: Objective, new, behaviour, batch) -> torch.Tensor:
    GRPOTrainer = _trl_grpo_trainer()

    loss_type = {"seq_mean": "grpo", "token_mean": "dapo", "seq_sum_norm": "dr_grpo"}[obj.loss_agg]
    n = batch.mask.shape[0]
    none = torch.zeros(n, 0, dtype=torch.long)  # the prompt: our rows hold it, masked out, in the "completion"
    inputs = {"prompt_ids": none, "prompt_mask": none, "completion_ids": batch.labels,
              "completion_mask": batch.mask.long(), "advantages": batch.advantages[:, 0],
              "old_per_token_logps": behaviour, "num_items_in_batch": batch.mask.sum()}
    tis = obj.tis_cap is not None
    if tis:  # TRL's token_truncate ratio, re-derived (it is computed inline in _generate_and_score_completions)
        inputs["importance_sampling_ratio"] = torch.clamp(torch.exp((behaviour - batch.engine_logprobs) * batch.mask),
                                                          max=obj.tis_cap)
    identity = SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction="sum": x, num_processes=1,
                               sync_gradients=True)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (new, torch.zeros_like(new), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=obj.ratio, beta=0.0,
        loss_type=loss_type, epsilon_low=obj.clip_low, epsilon_high=obj.clip_high, use_vllm=tis,
        vllm_importance_sampling_correction=tis, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=obj.norm_tokens, accelerator=identity,
        args=SimpleNamespace(delta=None, steps_per_generation=1, use_bias_correction_kl=False),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)})
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("name", list(SWITCHES))
def test_each_switch_is_trls_loss_and_gradient_on_the_same_tensors(name):
    obj = SWITCHES[name]
    batch, new, behaviour = _batch()  # all fresh: TRL's importance-sampling ratio weighs every token
    ours = obj.loss(new, behaviour, batch, _divisor(obj))
    (ours_grad,) = torch.autograd.grad(ours, new)
    theirs = _trl_loss(obj, new, behaviour, batch)
    (theirs_grad,) = torch.autograd.grad(theirs, new)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-6)
    assert torch.allclose(ours_grad, theirs_grad, atol=1e-7), (ours_grad - theirs_grad).abs().max()
    assert ours_grad.abs().sum() > 0


# -- baselines and overlong (rlslurm/rl/experience.py) --------------------------------------------------------

REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0]


def test_baselines_are_their_papers_formulas():
    k, mean = len(REWARDS), sum(REWARDS) / len(REWARDS)
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS) / k)
    grpo = Advantages(baseline="group_std").of_rewards(REWARDS)
    assert grpo == pytest.approx([(r - mean) / std for r in REWARDS], rel=1e-5)
    assert Advantages(baseline="group_mean").of_rewards(REWARDS) == pytest.approx([r - mean for r in REWARDS])
    loo = [r - sum(REWARDS[j] for j in range(k) if j != i) / (k - 1) for i, r in enumerate(REWARDS)]
    assert Advantages(baseline="loo").of_rewards(REWARDS) == pytest.approx(loo)
    # RLOO's advantage is the group-mean one scaled by k / (k - 1): the same direction, larger
    assert loo == pytest.approx([(r - mean) * k / (k - 1) for r in REWARDS])
    for baseline in ("group_std", "group_mean", "loo"):
        assert Advantages(baseline=baseline).of_rewards([0.5] * 4) is None


def test_baselines_against_trls_re_derived_advantages():
    """TRL 1.16 (grpo_trainer.py: scale_rewards group / none; rloo_trainer.py): the same up to TRL's std, which is
    Bessel-corrected with + 1e-4 (ours: the population std, + 1e-6, as before these switches)."""
    r = torch.tensor(REWARDS)
    k = len(REWARDS)
    trl_std = (r - r.mean()) / (r.std(unbiased=True) + 1e-4)
    ours = torch.tensor(Advantages(baseline="group_std").of_rewards(REWARDS))
    assert torch.allclose(ours * math.sqrt((k - 1) / k), trl_std, atol=1e-3)
    assert torch.allclose(torch.tensor(Advantages(baseline="group_mean").of_rewards(REWARDS)), r - r.mean())
    trl_rloo = r - (r.sum() - r) / (k - 1)
    assert torch.allclose(torch.tensor(Advantages(baseline="loo").of_rewards(REWARDS)), trl_rloo)


def test_overlong_penalty_is_dapos_soft_punishment():
    """DAPO eq. 13 with L_max = 20, L_cache = 4: 0 up to 16 tokens, (16 - |y|) / 4 in (16, 20]."""
    rule = Advantages(overlong="penalty", max_new_tokens=20, buffer_tokens=4, penalty=1.0)
    assert [rule.length_penalty(n) for n in (1, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert Advantages(overlong="penalty", max_new_tokens=20, buffer_tokens=4, penalty=0.5).length_penalty(18) == -0.25
    assert Advantages(overlong="filter", max_new_tokens=20, buffer_tokens=4).length_penalty(20) == 0.0


def _choices(lengths: list[int], cut: list[bool]) -> list[dict]:
    return [{"token_ids": [5] * n, "token_logprobs": [-0.1] * n, "policy_version": 0,
             "finish_reason": "length" if c else "stop"} for n, c in zip(lengths, cut)]


def test_overlong_filter_keeps_a_cut_response_in_the_baseline_and_out_of_the_loss():
    rewards = [1.0, 0.0, 0.0, 1.0]
    choices = _choices([3, 8, 2, 8], [False, True, False, True])
    full = Advantages().of_rewards(rewards)
    kept = group_samples([1, 4], choices, rewards, Advantages(overlong="filter", max_new_tokens=8))
    assert [s.advantage for s in kept] == pytest.approx([full[0], full[2]])  # the baseline saw all four
    assert group_samples([1, 4], choices, rewards, Advantages()) is not None
    # every response cut: nothing to train on, the group is dropped like a zero-variance one
    assert group_samples([1, 4], _choices([8, 8], [True, True]), [1.0, 0.0],
                         Advantages(overlong="filter", max_new_tokens=8)) is None


def test_overlong_penalty_shapes_the_rewards_before_the_advantages():
    rule = Advantages(overlong="penalty", max_new_tokens=8, buffer_tokens=4)
    # all right, but one response ran to the cut: the penalty alone makes the group teach
    samples = group_samples([1, 4], _choices([3, 8, 2], [False, True, False]), [1.0, 1.0, 1.0], rule)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert samples[1].advantage < 0 < samples[0].advantage


# -- what `rlslurm validate` refuses ---------------------------------------------------------------------------

REFUSED = [
    ("rl: {ratio: sequence, loss_agg: token_mean}\n", ["rl.ratio = 'sequence' with rl.loss_agg = 'token_mean'"]),
    ("rl: {ratio: sequence, loss_agg: seq_sum_norm}\n", ["rl.ratio = 'sequence'", "rl.loss_agg = 'seq_sum_norm'"]),
    ("rl: {overlong: penalty}\n", ["rl.overlong_buffer_tokens is required with rl.overlong = 'penalty'",
                                   "rollout.max_new_tokens = 8"]),
    ("rl: {overlong: penalty, overlong_buffer_tokens: 8}\n",
     ["rl.overlong_buffer_tokens = 8 must be below rollout.max_new_tokens = 8"]),
    ("rl: {overlong: filter, overlong_buffer_tokens: 2}\n",
     ["rl.overlong_buffer_tokens is ignored with rl.overlong = 'filter'"]),
    ("rl: {loss_norm_tokens: 16}\n", ["rl.loss_norm_tokens is ignored with rl.loss_agg = 'seq_mean'"]),
    ("rl: {loss_agg: seq_sum_norm, loss_norm_tokens: 4}\n",
     ["rl.loss_norm_tokens = 4 is below rollout.max_new_tokens = 8"]),
    ("rl: {clip_eps: 0.3, clip_eps_low: 0.2, clip_eps_high: 0.28}\n",
     ["rl.clip_eps is ignored with both rl.clip_eps_low and rl.clip_eps_high"]),
    ("rl: {dynamic_sampling_max_rounds: 8}\n",
     ["rl.dynamic_sampling_max_rounds is ignored with rl.dynamic_sampling = false"]),
    ("rl: {tis_cap: 2, max_staleness: 1}\n", ["rl.tis_cap = 2 does nothing with rl.max_staleness = 1"]),
    ("rl: {clip_eps_low: 1.0}\n", ["rl.clip_eps_low", "must be in (0, 1)"]),
    ("rl: {tis_cap: 0.5, max_staleness: 0}\n", ["rl.tis_cap", "range [1, 1000]"]),
    ("rl: {baseline: median}\n", ["rl.baseline", "group_std"]),
]


@pytest.mark.parametrize("text,fragments", REFUSED, ids=[f"refused{i:02d}" for i in range(len(REFUSED))])
def test_validate_refuses_a_bad_combination_naming_both_keys(tmp_path, text, fragments):
    from click.testing import CliRunner

    from rlslurm.cli.main import cli
    from rlslurm.errors import ConfigError

    path = tmp_path / "job.yaml"
    path.write_text("job: {name: x, kind: rl}\n" + text)
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == ConfigError.exit_code, result.output
    assert "Traceback" not in result.output
    message = " ".join(result.output.split())
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_the_recipes_of_the_family_validate(tmp_path):
    from rlslurm.config import load_config

    ok = ["rl: {clip_eps_low: 0.2, clip_eps_high: 0.28, loss_agg: token_mean, dynamic_sampling: true, "
          "overlong: penalty, overlong_buffer_tokens: 2}\n",                              # DAPO
          "rl: {baseline: group_mean, loss_agg: seq_sum_norm, loss_norm_tokens: 16}\n",   # Dr. GRPO
          "rl: {ratio: sequence, clip_eps_low: 0.0003, clip_eps_high: 0.0004}\n",         # GSPO
          "rl: {baseline: loo}\n",                                                        # RLOO
          "rl: {tis_cap: 2, max_staleness: 0}\n"]                                         # TIS
    for text in ok:
        path = tmp_path / "job.yaml"
        path.write_text("job: {name: x, kind: rl}\n" + text)
        load_config(path)

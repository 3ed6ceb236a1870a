"""The experience pipeline's bookkeeping (rlslurm/rl/pipeline.py), the streaming group assembler
(rlslurm/rl/experience.py) and the loss's guard for stale samples (rlslurm/rl/policy.py Policy.update).

    python -m pytest -q tests/unit/test_rl_pipeline.py      # ~5 s on 2 cores

The pipeline runs against a stand-in for the engines that serves one policy version at a time and notes
which version each step's rollout saw; a driver plays the trainer (take, train, sync), with random
sleeps on both sides so the threads interleave differently from run to run.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from rlslurm.errors import RlslurmError, StalenessError
from rlslurm.logprobs import CausalLMScorer
from rlslurm.rl.experience import Experience, GroupAssembler, Sample, build_samples, group_advantages
from rlslurm.rl.pipeline import ExperiencePipeline, ProducerGuard, stamp_staleness
from rlslurm.rl.policy import Policy
from rlslurm.tasks.arithmetic import Problem
from rlslurm.tokenizer import build_tokenizer


class Engines:
    """Serves one version at a time; a rollout during a sync, or two at once, is a schedule bug."""

    def __init__(self, seed: int, jitter_s: float = 0.004):
        self.version, self.syncing, self.rolling = 0, False, 0
        self.seen: dict[int, int] = {}
        self.taken = 0  # the step the trainer trains now
        self.ahead: list[int] = []
        self.rng, self.jitter_s = random.Random(seed), jitter_s
        self.lock = threading.Lock()

    def rollout(self, step: int, guard) -> tuple[int, int]:
        with self.lock:
            assert not self.syncing, f"rollout of step {step} during a sync"
            self.rolling += 1
            self.seen[step] = self.version
            self.ahead.append(step - self.taken)
        time.sleep(self.rng.random() * self.jitter_s)
        guard.beat()
        with self.lock:
            self.rolling -= 1
        return step, self.seen[step]

    def finish(self, pending: tuple[int, int], guard) -> Experience:
        step, version = pending
        time.sleep(self.rng.random() * self.jitter_s)
        return Experience([Sample([1], [5], 1.0, 1.0, version, [-0.1])], {"step": step}, {version: 8})

    def sync(self, version: int) -> None:
        with self.lock:
            assert self.rolling == 0, "sync while a rollout is in flight"
            self.syncing = True
        time.sleep(self.rng.random() * self.jitter_s)
        with self.lock:
            self.version, self.syncing = version, False


def drive(pipeline: ExperiencePipeline, engines: Engines, first: int, last: int, k: int, *, seed: int,
          stop_at: int | None = None) -> dict[int, dict]:
    """Play the trainer: take, stamp, train, then sync between rollouts; steps trained at version = step."""
    guard, rng, out = ProducerGuard(), random.Random(seed), {}
    for step in range(first, last if stop_at is None else stop_at):
        engines.taken = step
        exp = pipeline.take(step, guard)
        assert exp.stats["step"] == step
        out[step] = stamp_staleness(exp, step, k, step)
        time.sleep(rng.random() * 0.004)  # training
        pipeline.before_sync(step + 1, guard)
        engines.sync(step + 1)
        pipeline.synced(step + 1)
    return out


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_step_is_rolled_out_on_version_step_minus_k_and_staleness_never_passes_k(k, seed):
    engines, steps = Engines(seed), 12
    pipeline = ExperiencePipeline(engines.rollout, engines.finish, max_staleness=k, first_step=0,
                                  last_step=steps).start()
    try:
        stats = drive(pipeline, engines, 0, steps, k, seed=seed)
    finally:
        pipeline.close()
    assert engines.seen == {m: max(0, m - k) for m in range(steps)}
    assert {m: s["staleness_max"] for m, s in stats.items()} == {m: min(m, k) for m in range(steps)}
    assert max(engines.ahead) <= k  # never more than k steps made ahead of the one training
    assert pipeline.threaded == (k > 0)


@pytest.mark.parametrize("k", [1, 2])
def test_a_rollout_with_no_engine_left_finishes_on_the_trainers_next_sync(k):
    """The lone engine is lost in step 5's rollout (on version 5 - k): the producer waits (await_sync), the
    trainer's next sync goes ahead instead of waiting for that rollout, and step 5 is sampled on the synced
    weights: fresher than its schedule, staleness still within k; every other step as scheduled."""
    engines, steps, lost = Engines(seed=7), 10, 5
    pipeline: ExperiencePipeline

    def rollout(step, guard):
        if step == lost and engines.version == lost - k:
            assert pipeline.await_sync(step, timeout_s=30)
        return engines.rollout(step, guard)

    pipeline = ExperiencePipeline(rollout, engines.finish, max_staleness=k, first_step=0, last_step=steps).start()
    try:
        stats = drive(pipeline, engines, 0, steps, k, seed=7)
    finally:
        pipeline.close()
    assert engines.seen == {m: lost - k + 1 if m == lost else max(0, m - k) for m in range(steps)}
    assert stats[lost]["staleness_max"] == k - 1 and max(s["staleness_max"] for s in stats.values()) <= k


def test_await_sync_is_bounded_and_ends_with_close():
    pipeline = ExperiencePipeline(lambda s, g: (s, 0), lambda p, g: Experience([], {}), max_staleness=1,
                                  first_step=0, last_step=3)
    started = time.monotonic()
    assert pipeline.await_sync(1, timeout_s=0.3, poll_s=0.05) is False and time.monotonic() - started < 5
    threading.Timer(0.1, pipeline.stop).start()
    assert pipeline.await_sync(1, timeout_s=30, poll_s=0.05) is False


def test_k0_runs_inline_in_the_callers_thread_under_its_guard():
    threads = []

    def rollout(step, guard):
        threads.append(threading.current_thread())
        return step, 0

    pipeline = ExperiencePipeline(rollout, lambda p, g: Experience([], {"step": p[0]}), max_staleness=0,
                                  first_step=3, last_step=5).start()
    guard = ProducerGuard()
    exp = pipeline.take(3, guard)
    assert exp.stats["step"] == 3 and set(exp.stats) == {"step", "experience_wait_s"}
    assert threads == [threading.current_thread()] and pipeline.buffered(4, guard) == {}


def test_k0_through_the_thread_is_as_synchronous_as_inline():
    engines = Engines(seed=5)
    pipeline = ExperiencePipeline(engines.rollout, engines.finish, max_staleness=0, first_step=0, last_step=8,
                                  threaded=True).start()
    try:
        stats = drive(pipeline, engines, 0, 8, 0, seed=5)
    finally:
        pipeline.close()
    assert engines.seen == {m: m for m in range(8)} and max(engines.ahead) == 0
    assert all(s["staleness_max"] == 0 for s in stats.values())


@pytest.mark.parametrize("k", [1, 2])
def test_a_resumed_pipeline_with_the_checkpoints_buffer_makes_the_same_steps(k):
    steps, boundary = 12, 5
    engines = Engines(seed=3)
    pipeline = ExperiencePipeline(engines.rollout, engines.finish, max_staleness=k, first_step=0,
                                  last_step=steps).start()
    drive(pipeline, engines, 0, steps, k, seed=3, stop_at=boundary)
    saved = {m: Experience.from_json(e.to_json()) for m, e in pipeline.buffered(boundary, ProducerGuard()).items()}
    pipeline.close()
    assert sorted(saved) == list(range(boundary, boundary + k))
    assert {m: e.response_versions for m, e in saved.items()} == {m: {m - k: 8} for m in saved}

    # the requeued job: new engines serving the checkpoint's version, the buffer put back
    resumed = Engines(seed=4)
    resumed.version = boundary
    pipeline = ExperiencePipeline(resumed.rollout, resumed.finish, max_staleness=k, first_step=boundary,
                                  last_step=steps, buffered=saved).start()
    try:
        assert pipeline.restored == list(range(boundary, boundary + k))
        stats = drive(pipeline, resumed, boundary, steps, k, seed=4)
    finally:
        pipeline.close()
    assert resumed.seen == {m: m - k for m in range(boundary + k, steps)}  # what the uninterrupted run saw
    assert all(s["staleness_max"] == k for s in stats.values())


def test_a_producer_error_is_raised_where_the_trainer_waits_for_that_step():
    class EngineDown(RlslurmError):
        pass

    def rollout(step, guard):
        if step == 2:
            raise EngineDown("engine http://x: connection refused")
        return step, 0

    pipeline = ExperiencePipeline(rollout, lambda p, g: Experience([], {"step": p[0]}, {0: 1}), max_staleness=3,
                                  first_step=0, last_step=6, poll_s=0.01).start()
    guard = ProducerGuard()
    try:
        assert pipeline.take(0, guard).stats["step"] == 0 and pipeline.take(1, guard).stats["step"] == 1
        with pytest.raises(EngineDown, match="connection refused"):  # the engine's own error, its own type
            pipeline.take(2, guard)
        with pytest.raises(EngineDown):
            pipeline.before_sync(1, guard)
    finally:
        pipeline.close()


@pytest.mark.parametrize("k", [0, 1])
def test_experience_wait_is_what_training_did_not_hide(k):
    """`experience_wait_s`: in turn (k 0) the step waits out every rollout; ahead (k 1) the rollout of step 1 is
    made while step 0 "trains" (0.5 s here), and taking it costs the step less than a rollout (0.1 s): seen at 0.05
    s and more beside two real jobs on 2 cores, where the producer thread's wake-up waits for a core."""
    def rollout(step, guard):
        time.sleep(0.1)
        return step, 0

    pipeline = ExperiencePipeline(rollout, lambda p, g: Experience([], {"step": p[0]}), max_staleness=k,
                                  first_step=0, last_step=2, poll_s=0.01).start()
    guard = ProducerGuard()
    try:
        first = pipeline.take(0, guard).stats["experience_wait_s"]
        time.sleep(0.5)
        second = pipeline.take(1, guard).stats["experience_wait_s"]
    finally:
        pipeline.close()
    assert first >= 0.1
    assert second >= 0.1 if k == 0 else second < 0.1, (first, second)


def test_the_waiting_trainer_beats_only_when_the_producer_progressed():
    release = threading.Event()

    def rollout(step, guard):
        guard.beat()
        release.wait(5)
        return step, 0

    pipeline = ExperiencePipeline(rollout, lambda p, g: Experience([], {}, {0: 1}), max_staleness=1,
                                  first_step=0, last_step=1, poll_s=0.01).start()
    main = ProducerGuard()
    threading.Timer(0.2, release.set).start()
    try:
        pipeline.take(0, main)
    finally:
        pipeline.close()
    # the producer beat twice (in its rollout, at the end of it): the main thread saw progress, not time
    assert 1 <= main.beats <= 4


def _exp(versions: dict[int, int], sample_versions: list[int]) -> Experience:
    return Experience([Sample([1], [5], 1.0, 1.0, v, [-0.1]) for v in sample_versions], {}, versions)


def test_staleness_is_stamped_per_sample_and_summarised_over_every_response():
    exp = _exp({9: 6, 10: 2}, [9, 10, 9])
    assert stamp_staleness(exp, 10, 1, step=10) == {"staleness_mean": 0.75, "staleness_max": 1}
    assert [s.staleness for s in exp.samples] == [1, 0, 1]


@pytest.mark.parametrize("versions,why", [({7: 4}, "staleness 3"), ({11: 4}, "versions \\[11\\]")])
def test_a_sample_past_the_bound_or_from_the_future_never_reaches_the_loss(versions, why):
    with pytest.raises(StalenessError, match=why):
        stamp_staleness(_exp(versions, [next(iter(versions))]), 10, 2, step=10)


def test_experience_round_trips_through_json():
    exp = _exp({3: 8}, [3, 3])
    exp.stats = {"reward_mean": 0.25}
    back = Experience.from_json(exp.to_json())
    assert back == exp


# -- the streaming assembler ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_groups_assembled_in_any_arrival_order_equal_build_samples(seed):
    rng = random.Random(seed)
    problems = [Problem(a, "+", b) for a, b in [(1, 2), (5, 3), (4, 4), (9, 0), (2, 7)]]
    k, n_eng = 4, 2
    tok = build_tokenizer()
    encode = lambda text: tok(text)["input_ids"]  # noqa: E731
    choices = [{"engine": g % n_eng, "index": (g // n_eng) * k + j, "prompt_index": g, "token_ids": [4 + j],
                "token_logprobs": [-0.5], "policy_version": 2} for g in range(len(problems)) for j in range(k)]
    rewards = [rng.choice([0.0, 1.0, None]) for _ in choices]
    reference = build_samples(problems, choices, rewards, k, encode)

    assembler = GroupAssembler(problems, k, encode)
    by_engine = [[c for c in choices if c["engine"] == e] for e in range(n_eng)]
    events = [("choices", batch) for batch in by_engine]
    scored = list(zip(choices, rewards))
    rng.shuffle(scored)
    events += [("rewards", scored[i:i + 3]) for i in range(0, len(scored), 3)]
    rng.shuffle(events)
    for kind, payload in events:
        if kind == "choices":
            assembler.add_choices(payload)
        else:
            assembler.add_rewards({f"{c['engine']}:{c['index']}": r for c, r in payload})
    assert assembler.complete_groups == len(problems)
    assert assembler.samples() == reference
    assert assembler.rewards() == rewards


def test_a_group_gets_its_advantages_as_soon_as_its_last_reward_lands():
    problems = [Problem(1, "+", 2), Problem(5, "-", 3)]
    assembler = GroupAssembler(problems, 2, lambda text: [1])
    assembler.add_choices([{"engine": 0, "index": i, "prompt_index": i // 2, "token_ids": [4], "token_logprobs": [-1.0],
                            "policy_version": 0} for i in range(4)])
    assembler.add_rewards({"0:0": 1.0, "0:1": 0.0})
    assert assembler.complete_groups == 1
    with pytest.raises(RlslurmError, match="1 groups incomplete"):
        assembler.samples()
    assembler.add_rewards({"0:2": 1.0, "0:3": 1.0})
    samples, dropped = assembler.samples()
    assert dropped == 1 and [s.advantage for s in samples] == pytest.approx(group_advantages([1.0, 0.0]))


# -- the loss's guard for stale samples -------------------------------------------------------------------

def _samples(policy: Policy, shift: float, staleness: int) -> list[Sample]:
    """Two samples whose behaviour logprobs are the policy's own, shifted by `shift` (log-space)."""
    out = []
    for prompt, response, adv in [([1, 5, 15, 6, 17], [9, 2], 1.0), ([1, 7, 15, 7, 17], [5, 8, 2], -1.0)]:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            lp = CausalLMScorer(policy.model, fused=False)(ids, torch.ones_like(ids))[0, len(prompt) - 1:]
        out.append(Sample(prompt, response, 1.0, adv, 0, (lp + shift).tolist(), staleness))
    return out


def test_a_stale_sample_the_policy_moved_past_the_clip_gets_no_gradient(policy_and_guard):
    policy, guard = policy_and_guard
    # sampled when its tokens were 1 nat less likely: ratio e > 1 + clip with a positive advantage, so
    # min() takes the clipped, constant branch and the policy is not pushed further that way
    stats = policy.update(_samples(policy, shift=-1.0, staleness=1)[:1], guard)
    assert stats["clip_fraction"] == 1.0 and stats["grad_norm"] == 0.0
    assert stats["stale_logprob_drift"] == pytest.approx(1.0, abs=1e-5)


def test_a_stale_sample_sampled_by_the_same_weights_trains_as_a_fresh_one(policy_and_guard, tmp_path):
    policy, guard = policy_and_guard
    stale = policy.update(_samples(policy, shift=0.0, staleness=1), guard)
    fresh_policy = Policy(policy.job, policy.topo, tmp_path / "init")
    fresh = fresh_policy.update(_samples(fresh_policy, shift=0.0, staleness=0), guard)
    assert stale["loss"] == pytest.approx(fresh["loss"], abs=1e-5)
    assert stale["grad_norm"] == pytest.approx(fresh["grad_norm"], rel=1e-4)
    assert stale["clip_fraction"] == fresh["clip_fraction"] == 0.0

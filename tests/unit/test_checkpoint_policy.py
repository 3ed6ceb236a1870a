"""When to checkpoint: configured steps, Young/Daly from the measured cost, and the allocation cap."""

from __future__ import annotations

from rlslurm.checkpoint import CheckpointConfig, IntervalPolicy
from rlslurm.plan.checkpoint_interval import checkpoint_interval


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_configured_interval_counts_from_the_start_step():
    policy = IntervalPolicy(CheckpointConfig(interval_steps=5), start_step=10)
    assert [s for s in range(10, 17) if policy.due(s)] == [15, 16]  # due until a save happens
    policy.observe_save(15, 0.1)
    assert [s for s in range(15, 22) if policy.due(s)] == [20, 21]


def test_young_daly_needs_a_measured_step_then_matches_the_planner():
    policy = IntervalPolicy(CheckpointConfig(cost_s=490.0, mtbf_h=24.0))
    assert policy.interval_steps() is None and not policy.due(1000)
    policy.observe_step(120.0)
    expected = checkpoint_interval(490.0, 24 * 3600.0, 120.0).daly_steps
    assert policy.interval_steps() == expected and 70 <= expected <= 80  # the lecture's ~77 steps
    assert not policy.due(expected - 1) and policy.due(expected)


def test_measured_cost_replaces_the_configured_one():
    policy = IntervalPolicy(CheckpointConfig(cost_s=490.0, mtbf_h=24.0))
    policy.observe_step(120.0)
    before = policy.interval_steps()
    policy.observe_save(0, 30.0)
    assert policy.cost_s == 30.0
    assert policy.interval_steps() == checkpoint_interval(30.0, 24 * 3600.0, 120.0).daly_steps < before


def test_interval_is_capped_by_the_allocation():
    policy = IntervalPolicy(CheckpointConfig(cost_s=60.0, mtbf_h=1000.0), time_limit_s=600.0)
    policy.observe_step(120.0)
    assert policy.interval_steps() == 4  # (600 - 60) s / 120 s
    configured = IntervalPolicy(CheckpointConfig(interval_steps=50, cost_s=60.0), time_limit_s=600.0)
    configured.observe_step(120.0)
    assert configured.interval_steps() == 4


def test_a_save_lands_before_the_time_limit_even_with_a_long_interval():
    clock = Clock()
    policy = IntervalPolicy(CheckpointConfig(interval_steps=10_000, cost_s=20.0), time_limit_s=1000.0, clock=clock)
    policy.observe_step(10.0)
    clock.now = 960.0  # 40 s left > one step + C
    assert not policy.due(96)
    clock.now = 975.0  # 25 s left < 10 s step + 20 s save
    assert policy.remaining_s() == 25.0 and policy.due(97)
    policy.observe_save(97, 5.0)
    clock.now = 990.0
    assert not policy.due(98)

"""rlslurm/rl/batches.py: how a step's samples become mini-batches and micro-batches on every rank."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from rlslurm.rl.batches import micro_batch_counts, micro_batches, mini_batches, share_sizes, split_sizes


def test_share_sizes_are_the_round_robin_deal():
    assert share_sizes(7, 2) == [4, 3] and share_sizes(1, 2) == [1, 0] and share_sizes(0, 3) == [0, 0, 0]
    samples = list(range(11))
    assert share_sizes(11, 4) == [len(samples[r::4]) for r in range(4)]


def test_split_sizes_are_near_equal_and_contiguous():
    assert split_sizes(7, 3) == [3, 2, 2] and split_sizes(2, 4) == [1, 1, 0, 0] and split_sizes(0, 2) == [0, 0]


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 300), world=st.integers(1, 8), count=st.integers(1, 12), micro=st.integers(1, 40))
def test_every_rank_agrees_on_each_mini_batch_without_talking(total: int, world: int, count: int, micro: int):
    samples = list(range(total))
    sizes = share_sizes(total, world)
    per_rank = [mini_batches(samples[r::world], sizes, r, count) for r in range(world)]
    counts = micro_batch_counts(sizes, count, micro)
    for j in range(count):
        union = sorted(s for parts in per_rank for s in parts[j].samples)
        # Each rank knows the mini-batch's size over all ranks (the loss divisor) from the step's count alone.
        assert {parts[j].total for parts in per_rank} == {len(union)}
        # Megatron's schedule runs as many micro-batches on every rank, enough for the fullest rank.
        most = max(len(micro_batches(parts[j].samples, micro)) for parts in per_rank)
        assert counts[j] == (max(1, most) if union else 0)
    # Every sample lands in exactly one mini-batch, in order on its rank.
    for r, parts in enumerate(per_rank):
        assert [s for p in parts for s in p.samples] == samples[r::world]
    assert sum(len(p.samples) for parts in per_rank for p in parts) == total


def test_a_share_that_is_not_the_dealt_one_is_refused():
    with pytest.raises(ValueError, match="rank 1 holds 2 samples, the dealt sizes say 3"):
        mini_batches([1, 2], [4, 3], 1, 2)

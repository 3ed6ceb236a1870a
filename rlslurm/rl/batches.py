"""How one RL step's samples become optimizer steps (mini-batches) and forward passes (micro-batches).

    parts = mini_batches(share, share_sizes(step_total, world), rank, job.rl.mini_batches)
    for part in parts:                                   # one optimizer step each
        for micro in micro_batches(part.samples, job.parallel.micro_batch_size):   # one forward + backward
            loss = grpo_objective(..., samples=part.total / data_parallel_size)   # DDP averages over ranks

The RL loop deals rank r the samples `exp.samples[r::world]`; each rank cuts its share into
`rl.mini_batches` near-equal parts in order, and mini-batch j is the union of every rank's part j.
Every rank can work out every rank's part sizes from the step's sample count alone, so the ranks agree
on each mini-batch's sequence count (the loss divisor that makes the loss the exact mean over the whole
mini-batch, not a mean of per-rank or per-micro-batch means) and on the number of optimizer steps without
a collective: a mini-batch no rank has a sample in is skipped by all of them, one a rank has none of is
joined by that rank with a zero-weight row (DDP's all-reduce and Megatron's distributed optimizer are
collective, so every rank must take every step).

`behaviour_forward(mini_batches)` says whether an update runs a no-grad forward of its samples before the first
optimizer step (both policies, and the plan's train_seconds, follow it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class MiniBatch(Generic[T]):
    """This rank's part of one mini-batch, and the mini-batch's size over all data-parallel ranks."""

    samples: list[T]
    total: int
    """Sequences in the mini-batch on every data-parallel rank together (0: every rank skips it)."""


def share_sizes(total: int, world: int) -> list[int]:
    """Samples each rank gets of `total` dealt round-robin (`samples[rank::world]`)."""
    return [len(range(rank, total, world)) for rank in range(world)]


def split_sizes(n: int, count: int) -> list[int]:
    """`n` items in `count` contiguous parts as near equal as they divide (the first ones one larger)."""
    return [n // count + (1 if i < n % count else 0) for i in range(count)]


def mini_batches(share: list[T], sizes: list[int], rank: int, count: int) -> list[MiniBatch[T]]:
    """`share` (this data-parallel rank's samples; `sizes`: every rank's share size) in `count` mini-batches."""
    if len(share) != sizes[rank]:
        raise ValueError(f"rank {rank} holds {len(share)} samples, the dealt sizes say {sizes[rank]}")
    parts = [split_sizes(n, count) for n in sizes]
    out, start = [], 0
    for j, size in enumerate(parts[rank]):
        out.append(MiniBatch(share[start:start + size], sum(p[j] for p in parts)))
        start += size
    return out


def micro_batches(samples: list[T], size: int) -> list[list[T]]:
    """`samples` in forward passes of at most `size` (parallel.micro_batch_size) each."""
    return [samples[i:i + size] for i in range(0, len(samples), size)]


def micro_batch_counts(sizes: list[int], count: int, size: int) -> list[int]:
    """Per mini-batch, the most micro-batches any data-parallel rank runs in it (at least one where the
    mini-batch has a sample): Megatron's schedule runs as many on every rank."""
    parts = [split_sizes(n, count) for n in sizes]
    return [max(1, max(math.ceil(p[j] / size) for p in parts)) if sum(p[j] for p in parts) else 0
            for j in range(count)]

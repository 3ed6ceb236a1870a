"""Checkpoint interval from the checkpoint cost C and the mean time between failures M.

Young (1974): tau = sqrt(2 C M). Daly (2006), higher order, for C < 2M:
tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C; for C >= 2M, tau = M.
The lecture: C = 490 s, M = 24 h -> Young 9,202 s = ~77 steps of 120 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: seconds of work between two checkpoints."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (exact to second order in C/M); equals M once C >= 2M."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


@dataclass(frozen=True)
class Interval:
    """A checkpoint interval in seconds and whole steps (at least 1)."""

    young_s: float
    daly_s: float
    young_steps: int
    daly_steps: int


def checkpoint_interval(cost_s: float, mtbf_s: float, step_s: float, wall_s: float | None = None) -> Interval:
    """Young and Daly intervals in seconds and steps; capped at the wall time of one allocation.

    The cap keeps at least one checkpoint inside every allocation: an interval longer than the
    time limit would lose the whole allocation on each requeue.
    """
    young, daly = young_interval_s(cost_s, mtbf_s), daly_interval_s(cost_s, mtbf_s)
    if wall_s is not None:
        young, daly = min(young, wall_s), min(daly, wall_s)

    def steps(seconds: float) -> int:
        return max(1, round(seconds / step_s)) if step_s > 0 else 1

    return Interval(young, daly, steps(young), steps(daly))

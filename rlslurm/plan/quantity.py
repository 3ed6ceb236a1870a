"""A number the planner computed, with the terms it came from, so `rlslurm plan --explain` can show them.

    Q("expert optimizer", 10.5, "GB", "4.375e9 params x 12 B / expert-DP 5")
    -> "expert optimizer = 4.375e9 params x 12 B / expert-DP 5 = 10.50 GB"

Every figure of the plan is a Q: a user who disagrees with a number sees which input to calibrate.
Memory is in decimal GB (1e9 bytes), as vendors and the lecture count it.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Q:
    """One computed figure: label, value, unit, and the formula with its numbers filled in."""

    label: str
    value: float
    unit: str
    how: str = ""

    def __float__(self) -> float:
        return float(self.value)

    def text(self) -> str:
        return f"{num(self.value)} {self.unit}".rstrip()

    def explain(self) -> str:
        terms = f"{self.how} = " if self.how else ""
        return f"{self.label} = {terms}{self.text()}"


def num(value: float) -> str:
    """Two decimals below 100 (two digits below 0.01), one below 1000, whole above: narrow, exact enough."""
    if value != value:  # NaN
        return "-"
    magnitude = abs(value)
    if 0 < magnitude < 0.01:
        return f"{value:.2g}"
    if magnitude >= 1000 or (magnitude >= 100 and float(value).is_integer()):
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.1f}"
    return f"{value:.2f}"


def params(count: float) -> str:
    """A parameter count as the lecture writes it, in units of 1e9 from 1e8 up: 35e9, 4.375e9, 0.22e9."""
    if abs(count) >= 1e8:
        return f"{count / 1e9:.4g}e9"
    return f"{count:,.0f}"


def gb(nbytes: float) -> float:
    return nbytes / GB

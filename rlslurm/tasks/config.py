"""`task:` in a job YAML: the built-in verifiable task and its generated splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    name: Literal["arithmetic"] = "arithmetic"
    """The built-in task: arithmetic = short sums with exact integer answers."""
    max_operand: int = 20
    """Largest operand of generated problems."""
    train_size: int = 2000
    """Generated training problems."""
    eval_size: int = 200
    """Generated held-out problems (disjoint from train)."""
    seed: int = 1234
    """Seed of the data generator."""

    def __post_init__(self):
        check(self.max_operand >= 1, "max_operand", "must be >= 1")
        check(self.train_size >= 1, "train_size", "must be >= 1")
        check(self.eval_size >= 1, "eval_size", "must be >= 1")

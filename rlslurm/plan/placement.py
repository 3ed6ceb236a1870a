"""Where rollout runs: colocated with training (time-shared, offload) or on nodes of its own.

`placement:` in a job YAML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    mode: Literal["auto", "colocate", "separate"] = "auto"
    """auto takes the plan's recommendation; colocate time-shares GPUs; separate gives rollout its own nodes."""
    rollout_nodes: int | None = None
    """Nodes given to rollout when separate; null = the plan's recommendation."""
    offload: bool = True
    """When colocated, move training state to host RAM during rollout."""

    def __post_init__(self):
        check(self.rollout_nodes is None or self.rollout_nodes >= 0, "rollout_nodes", "must be >= 0")

"""`diag:` in a job YAML: heartbeats, watchdog, hang policy and stack dumps of the operations kit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class DiagConfig:
    heartbeat_interval_s: float = 1.0
    """Least seconds between two heartbeat writes of one process (beats in between are coalesced)."""
    hang_timeout_s: float = 300.0
    """Seconds without progress before a rank counts as hung, for phases without their own timeout."""
    phase_timeouts_s: dict[str, float] = field(default_factory=dict)
    """Per-phase override of hang_timeout_s, e.g. {rollout: 600, checkpoint: 900}."""
    watch_interval_s: float = 1.0
    """Seconds between two reads of the heartbeats by the watchdog."""
    hang_policy: Literal["requeue", "fail", "dump"] = "requeue"
    """On a hang: dump stacks then requeue the job, fail it, or only dump."""
    native_stacks: bool = True
    """Ask py-spy for native (C/C++) frames too; falls back to Python frames where that fails."""

    def __post_init__(self):
        check(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be > 0 (seconds)")
        check(self.hang_timeout_s > 0, "hang_timeout_s",
              "must be > 0 (seconds without progress before a rank counts as hung)")
        for phase, value in self.phase_timeouts_s.items():
            check(value > 0, f"phase_timeouts_s.{phase}", "must be > 0 (seconds)")
        check(self.watch_interval_s > 0, "watch_interval_s", "must be > 0 (seconds)")

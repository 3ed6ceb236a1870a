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
    stack_dump_timeout_s: float = 20.0
    """Seconds one stack dump of one process may take (py-spy, then the faulthandler fallback)."""
    kill_grace_s: float = 10.0
    """On a hang with policy requeue or fail: seconds between SIGTERM and SIGKILL of the wedged ranks."""
    log_tail_lines: int = 200
    """Lines of each log (and of metrics.jsonl) that `rlslurm diag` puts into its bundle."""
    agent_idle_exit_s: float = 600.0
    """Seconds the node agent waits for a first running heartbeat of its node before it exits (ranks that
    died before their phase guard, or an entrance without one, must not leave it behind forever)."""

    def __post_init__(self):
        check(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be > 0 (seconds)")
        check(self.hang_timeout_s > 0, "hang_timeout_s",
              "must be > 0 (seconds without progress before a rank counts as hung)")
        for phase, value in self.phase_timeouts_s.items():
            check(value > 0, f"phase_timeouts_s.{phase}", "must be > 0 (seconds)")
        check(self.watch_interval_s > 0, "watch_interval_s", "must be > 0 (seconds)")
        check(self.stack_dump_timeout_s > 0, "stack_dump_timeout_s", "must be > 0 (seconds)")
        check(self.kill_grace_s >= 0, "kill_grace_s", "must be >= 0 (seconds)")
        check(self.log_tail_lines >= 1, "log_tail_lines", "must be >= 1 (lines)")
        check(self.agent_idle_exit_s > 0, "agent_idle_exit_s", "must be > 0 (seconds)")

    def timeout_for(self, phase: str | None) -> float:
        """Seconds without progress after which a rank in `phase` counts as hung."""
        return self.phase_timeouts_s.get(phase or "", self.hang_timeout_s)

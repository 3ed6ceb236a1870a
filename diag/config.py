"""`diag:` in a job YAML: heartbeats, watchdog, hang policy and stack dumps of the operations kit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlslurm.configfile import check, check_range

PHASES = ("start", "data", "train", "eval", "checkpoint", "export", "rollout", "reward", "score", "advantage", "sync",
          "wait_experience", "idle")
"""Every phase a process reports through its phase guard (`guard.phase(name)`); diag.phase_timeouts_s names them."""


@dataclass(frozen=True, kw_only=True)
class DiagConfig:
    heartbeat_interval_s: float = 1.0
    """Least seconds between two heartbeat writes of one process (beats in between are coalesced). Range (0, 3600]."""
    hang_timeout_s: float = 300.0
    """Seconds without progress before a rank counts as hung, for phases without their own timeout.
    Range (0, 604800]."""
    phase_timeouts_s: dict[str, float] = field(default_factory=dict)
    """Per-phase override of hang_timeout_s, e.g. {rollout: 600, checkpoint: 900}; keys are phases of PHASES.
    Range (0, 604800]."""
    watch_interval_s: float = 1.0
    """Seconds between two reads of the heartbeats by the watchdog. Range [0.01, 3600]."""
    hang_policy: Literal["requeue", "fail", "dump"] = "requeue"
    """On a hang: dump stacks then requeue the job, fail it, or only dump."""
    native_stacks: bool = True
    """Ask py-spy for native (C/C++) frames too; falls back to Python frames where that fails."""
    stack_dump_timeout_s: float = 20.0
    """Seconds one stack dump of one process may take (py-spy, then the faulthandler fallback). Range (0, 3600]."""
    kill_grace_s: float = 10.0
    """On a hang with policy requeue or fail: seconds between SIGTERM and SIGKILL of the wedged ranks.
    Range [0, 3600]."""
    log_tail_lines: int = 200
    """Lines of each log (and of metrics.jsonl) that `rlslurm diag` puts into its bundle. Range [1, 1000000]."""
    collective_trace_entries: int = 2000
    """Collectives torch's flight recorder keeps per trainer rank (TORCH_FR_BUFFER_SIZE), served on a node-local
    unix socket; on a hang the node agent reads every rank's to name the one behind, or the one that took
    another collective, with the op and sequence number (diag/collectives.py). 0 = off. Range [0, 1000000]."""
    memory_every_steps: int = 25
    """On a CPU trainer, meter live tensor memory on step 1 and every N-th step after (rlslurm/memory_meter.py:
    it costs about half of a metered train phase of the tiny model); the other steps record nulls. A GPU's
    allocator counters are read every step whatever this says. 0 = never on the CPU. Range [0, 1000000]."""
    agent_idle_exit_s: float = 600.0
    """Seconds the node agent waits for a first running heartbeat of its node before it exits (ranks that
    died before their phase guard, or an entrance without one, must not leave it behind forever).
    Range (0, 604800]."""

    def __post_init__(self):
        check_range(self.heartbeat_interval_s, "heartbeat_interval_s", 0, 3600, low_open=True, note="seconds")
        check_range(self.hang_timeout_s, "hang_timeout_s", 0, 604_800, low_open=True,
                    note="seconds without progress before a rank counts as hung")
        for phase, value in self.phase_timeouts_s.items():
            check(phase in PHASES, f"phase_timeouts_s.{phase}",
                  f"is not a phase; the phases are {', '.join(PHASES)}")
            check_range(value, f"phase_timeouts_s.{phase}", 0, 604_800, low_open=True, note="seconds")
        # The watchdog polls at this interval: below 10 ms it only spins.
        check_range(self.watch_interval_s, "watch_interval_s", 0.01, 3600, note="seconds")
        check_range(self.stack_dump_timeout_s, "stack_dump_timeout_s", 0, 3600, low_open=True, note="seconds")
        check_range(self.kill_grace_s, "kill_grace_s", 0, 3600, note="seconds")
        check_range(self.log_tail_lines, "log_tail_lines", 1, 1_000_000, note="lines")
        check_range(self.collective_trace_entries, "collective_trace_entries", 0, 1_000_000, note="entries")
        check_range(self.memory_every_steps, "memory_every_steps", 0, 1_000_000, note="steps")
        check_range(self.agent_idle_exit_s, "agent_idle_exit_s", 0, 604_800, low_open=True, note="seconds")

    def timeout_for(self, phase: str | None) -> float:
        """Seconds without progress after which a rank in `phase` counts as hung."""
        return self.phase_timeouts_s.get(phase or "", self.hang_timeout_s)

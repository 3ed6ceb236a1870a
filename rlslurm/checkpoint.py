"""Atomic checkpoints: temp dir, fsync, manifest (sizes + checksums), rename, `latest` pointer.

`checkpoint:` in a job YAML.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval_steps: int | None = None
    """Steps between periodic checkpoints; null = Young/Daly from the measured cost and mtbf_h."""
    cost_s: float = 490.0
    """Seconds one checkpoint costs, until measured (C in Young/Daly; the lecture's 490 s)."""
    mtbf_h: float = 24.0
    """Mean time between failures of the whole job, in hours (M in Young/Daly)."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    max_no_progress_restarts: int = 3
    """Restarts in a row that make no step of progress before the job stops requeueing itself."""

    def __post_init__(self):
        check(self.interval_steps is None or self.interval_steps >= 1, "interval_steps", "must be >= 1")
        check(self.cost_s >= 0, "cost_s", "must be >= 0 (seconds)")
        check(self.mtbf_h > 0, "mtbf_h", "must be > 0 (hours)")
        check(self.keep >= 1, "keep", "must be >= 1")
        check(self.max_no_progress_restarts >= 1, "max_no_progress_restarts", "must be >= 1")

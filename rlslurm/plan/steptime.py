"""Step-time split of one RL step (rollout / reward / train / sync) and the amortisation of a change.

`timing:` in a job YAML: measured or estimated phase times that the planner scales.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    train_step_s: float = 1.0
    """Seconds of one training step measured with `train_step_ref_gpus` training GPUs."""
    train_step_ref_gpus: int | None = None
    """GPU count at which train_step_s was measured; null = all GPUs of the cluster."""
    rollout_s: float = 1.0
    """Seconds of the rollout phase of one step (generation of all samples)."""
    reward_s: float | None = None
    """Override: seconds of the reward phase; null = computed from reward.latency_s and concurrency."""
    total_steps: int = 100
    """Steps the job will run; the planner amortises per-step savings over them."""

    def __post_init__(self):
        for name in ("train_step_s", "rollout_s"):
            check(getattr(self, name) >= 0, name, "must be >= 0 (seconds)")
        check(self.train_step_ref_gpus is None or self.train_step_ref_gpus >= 1, "train_step_ref_gpus",
              "must be >= 1")
        check(self.reward_s is None or self.reward_s >= 0, "reward_s", "must be >= 0 (seconds)")
        check(self.total_steps >= 1, "total_steps", "must be >= 1")

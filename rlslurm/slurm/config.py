"""`cluster:` in a job YAML: where the job runs and how SLURM is asked for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    backend: Literal["auto", "slurm", "local"] = "auto"
    """slurm = a heterogeneous SLURM job; local = this machine via submitit's local executor; auto = slurm where sbatch exists."""
    train_partition: str = "train"
    """Partition of het component 0 (trainer ranks + controller)."""
    rollout_partition: str = "rollout"
    """Partition of het component 1 (rollout engines)."""
    tasks_per_node: int | None = None
    """Tasks (ranks) per node; null = hardware.gpus_per_node."""
    cpus_per_task: int = 1
    """CPUs SLURM gives each task."""
    mem_gb: float | None = None
    """Memory per node in GB asked of SLURM; null = the partition's default."""
    time_limit_min: int = 60
    """Wall-clock limit of one allocation, in minutes; the job requeues itself before it."""
    signal_before_s: int = 90
    """Seconds before the time limit that the pre-timeout signal arrives (--signal)."""
    gres_per_node: str | None = None
    """GRES asked per node, e.g. gpu:8; null = none (CPU)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Further #SBATCH options for every component, e.g. [--account=ml, --qos=high]."""
    run_root: str = "runs"
    """Directory (on the shared filesystem) under which each job gets its run directory."""

    def __post_init__(self):
        check(bool(self.train_partition), "train_partition", "must not be empty")
        check(bool(self.rollout_partition), "rollout_partition", "must not be empty")
        check(self.tasks_per_node is None or self.tasks_per_node >= 1, "tasks_per_node", "must be >= 1")
        check(self.cpus_per_task >= 1, "cpus_per_task", "must be >= 1")
        check(self.mem_gb is None or self.mem_gb > 0, "mem_gb", "must be > 0 (GB)")
        check(self.time_limit_min >= 1, "time_limit_min", "must be >= 1 (minutes)")
        check(self.signal_before_s >= 0, "signal_before_s", "must be >= 0 (seconds)")
        check(self.signal_before_s < self.time_limit_min * 60, "signal_before_s",
              f"must be less than cluster.time_limit_min x 60 = {self.time_limit_min * 60}")

"""`cluster:` in a job YAML: where the job runs and how SLURM is asked for it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rlslurm.configfile import FieldError, check, check_path, check_range


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    backend: Literal["auto", "slurm", "local"] = "auto"
    """slurm = a heterogeneous SLURM job; local = this machine via submitit's local executor; auto = slurm where
    sbatch exists."""
    train_partition: str = "train"
    """Partition of het component 0 (trainer ranks + controller); a SLURM name (a comma list allowed)."""
    rollout_partition: str = "rollout"
    """Partition of het component 1 (rollout engines); a SLURM name (a comma list allowed)."""
    tasks_per_node: int | None = None
    """Tasks (ranks) per node; null = hardware.gpus_per_node (and when set, it must equal it). Range [1, 64]."""
    cpus_per_task: int = 1
    """CPUs SLURM gives each task. Range [1, 1024]."""
    mem_gb: float | None = None
    """Memory per node in GB asked of SLURM (whole GB); null = the partition's default. Range [1, 100000]."""
    time_limit_min: int = 60
    """Wall-clock limit of one allocation, in minutes; the job requeues itself before it. Range [1, 525600]."""
    signal_before_s: int = 90
    """Seconds before the time limit that the pre-timeout signal arrives (--signal). Range [0, 86400]."""
    gres_per_node: str | None = None
    """GRES asked per node by components 0 and 1, e.g. nvme:1; null = none. Not GPUs, unless hardware.profile
    is cpu: a job on GPUs asks its own from the plan (--gpus-per-node per component; `rlslurm plan` shows them)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Further #SBATCH options for every component as --name=value or --flag, e.g. [--account=ml, --qos=high];
    not the ones rlslurm sets from other keys (--time, --partition, --gres, ...)."""
    run_root: str = "runs"
    """Directory (on the shared filesystem) under which each job gets its run directory."""

    def __post_init__(self):
        for key in ("train_partition", "rollout_partition"):
            check(bool(getattr(self, key)), key, "must not be empty")
            check_partition(getattr(self, key), key)
        check_range(self.tasks_per_node, "tasks_per_node", 1, 64)
        check_range(self.cpus_per_task, "cpus_per_task", 1, 1024)
        check_range(self.mem_gb, "mem_gb", 1, 100_000, note="GB; SLURM takes whole GB")
        check_range(self.time_limit_min, "time_limit_min", 1, 525_600, note="minutes")
        check_range(self.signal_before_s, "signal_before_s", 0, 86_400, note="seconds")
        check(self.signal_before_s < self.time_limit_min * 60, "signal_before_s",
              f"must be less than cluster.time_limit_min x 60 = {self.time_limit_min * 60}")
        if self.gres_per_node is not None:
            check(bool(_GRES.fullmatch(self.gres_per_node)) and len(self.gres_per_node) <= 256, "gres_per_node",
                  "must be a SLURM GRES list such as gpu:8 or nvme:1 (letters, digits, ':', ',', '.', '_', '-')")
        check(len(self.extra_sbatch) <= 64, "extra_sbatch", f"holds {len(self.extra_sbatch)} options; at most 64")
        for i, option in enumerate(self.extra_sbatch):
            check_sbatch_option(option, f"extra_sbatch[{i}]")
        check_path(self.run_root, "run_root")


_GRES = re.compile(r"[A-Za-z0-9_.:,()/+-]+")
_SBATCH_OPTION = re.compile(r"--([a-z][a-z0-9-]*)(=[^\x00-\x1f\x7f]*)?")

OWNED_SBATCH = {
    "time": "cluster.time_limit_min", "partition": "cluster.train_partition", "gres": "cluster.gres_per_node",
    "mem": "cluster.mem_gb", "cpus-per-task": "cluster.cpus_per_task", "job-name": "job.name",
    "signal": "cluster.signal_before_s", "nodes": "hardware.nodes and placement.rollout_nodes",
    "ntasks-per-node": "cluster.tasks_per_node", "ntasks": "cluster.tasks_per_node",
    "requeue": "rlslurm (every job requeues itself)", "no-requeue": "rlslurm (every job requeues itself)",
    "output": "rlslurm (logs go to the run directory)", "error": "rlslurm (logs go to the run directory)",
    "open-mode": "rlslurm (logs are appended across requeues)", "array": "rlslurm (one job per submit)",
    **dict.fromkeys(("gpus", "gpus-per-node", "gpus-per-task", "gpu-bind"),
                    "the plan's GPU placement (hardware.profile, hardware.gpus_per_node, rollout.tp)"),
}
"""sbatch options rlslurm writes itself, and the key that sets each: in extra_sbatch they would override it
(submitit lets additional parameters win) while the plan and the job still believe the key."""


def check_partition(value: str | None, key: str) -> None:
    """A SLURM partition name, or a comma list of them."""
    if value is None:
        return
    check(len(value) <= 256 and all(_PARTITION.fullmatch(p) for p in value.split(",")), key,
          "must be a SLURM partition name (letters, digits, '.', '_', '-'; a comma list allowed)")


_PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_sbatch_option(option: str, key: str) -> None:
    """One cluster.extra_sbatch item: --name=value or --flag, on one line, not an option rlslurm owns."""
    m = _SBATCH_OPTION.fullmatch(option) if len(option) <= 1024 else None
    if m is None:
        raise FieldError(key, "must be one sbatch option as --name=value or --flag (long form, one line, at most "
                              "1024 characters)")
    owner = OWNED_SBATCH.get(m.group(1))
    if owner is not None:
        raise FieldError(key, f"sets --{m.group(1)}, which rlslurm sets from {owner}: set it there")

"""The job config: one YAML file, loaded once into the typed configs of each component.

    job: {name, kind}          this module        plan: rlslurm/plan/*
    cluster     rlslurm/slurm/config.py           model      rlslurm/modelspec.py
    parallel    rlslurm/plan/parallel.py          hardware   rlslurm/plan/hardware.py
    memory      rlslurm/plan/memory.py            timing     rlslurm/plan/steptime.py
    placement   rlslurm/plan/placement.py         rollout    rlslurm/rollout/config.py
    train       rlslurm/train_config.py           rl         rlslurm/rl/config.py
    task        rlslurm/tasks/config.py           reward     rlslurm/reward/config.py
    data        rlslurm/data/config.py
    sync        rlslurm/sync/config.py            checkpoint rlslurm/checkpoint.py
    diag        diag/config.py (rlslurm.diag.config)
    network     rlslurm/network.py                logging    rlslurm/metrics_sinks.py

Checks between sections live in rlslurm/config_rules.py (`job_rules`, run by `JobConfig.__post_init__`) and
name every key involved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlslurm.checkpoint import CheckpointConfig
from rlslurm.config_rules import job_rules
from rlslurm.configfile import FieldError, check_name, load_mapping, read_yaml
from rlslurm.data.config import DataConfig
from rlslurm.diag.config import DiagConfig
from rlslurm.errors import ConfigError
from rlslurm.metrics_sinks import LoggingConfig
from rlslurm.modelspec import ModelConfig
from rlslurm.network import NetworkConfig
from rlslurm.plan.hardware import HardwareConfig
from rlslurm.plan.memory import MemoryConfig, resolve as resolve_memory
from rlslurm.plan.parallel import ParallelConfig
from rlslurm.plan.placement import PlacementConfig
from rlslurm.plan.steptime import TimingConfig
from rlslurm.reward.config import RewardConfig
from rlslurm.rl.config import RLConfig
from rlslurm.rollout.config import RolloutConfig
from rlslurm.safeyaml import clip, read_text
from rlslurm.slurm.config import ClusterConfig
from rlslurm.sync.config import SyncConfig
from rlslurm.tasks.config import TaskConfig
from rlslurm.train_config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str = "rlslurm-job"
    """Job name shown by SLURM and used in the run directory's name: 1 to 64 letters, digits, '.', '_' or '-',
    starting with a letter or digit."""
    kind: Literal["sft", "rl", "toy"] = "rl"
    """Which entrance: sft = offline data, rl = GRPO with rollout, reward and weight sync, toy = the spine's
    deterministic test loop."""

    def __post_init__(self):
        check_name(self.name, "name", "it names the run directory and the SLURM job")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    job: JobSpec = field(default_factory=JobSpec)
    """What the job is."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where it runs (SLURM partitions or this machine)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's shape."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The trainer's parallel layout."""
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    """Nodes, GPUs and bandwidths."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The trainer's memory model."""
    timing: TimingConfig = field(default_factory=TimingConfig)
    """Measured or estimated phase times."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Colocate or separate rollout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engines."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Trainer settings shared by SFT and RL."""
    rl: RLConfig = field(default_factory=RLConfig)
    """GRPO settings."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The built-in task and its data (what the job trains on when data.train is unset)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The user's own dataset: files, layout, columns (rlslurm/data/)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring and its degradation policy."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight sync to the engines."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint interval and retention."""
    diag: DiagConfig = field(default_factory=DiagConfig)
    """Operations kit: heartbeats, watchdog, stacks."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """The NCCL / Gloo environment of every process: trainer ranks, engines, reward service."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where each step's metrics go besides metrics.jsonl: TensorBoard, Weights & Biases (offline)."""

    def __post_init__(self):
        # Every rule between sections lives in rlslurm/config_rules.py; the first one broken is the error.
        for key, message in job_rules(self):
            raise FieldError(key, message)

    @property
    def resolved_memory(self) -> MemoryConfig:
        """`memory:` with its nulls set to what train.backend runs on hardware.profile (rlslurm/plan/memory.py)."""
        return resolve_memory(self.memory, self.train.backend, self.hardware.profile)

    def accumulates(self, dp: int) -> bool:
        """Whether one optimizer step of the trainer takes more than one micro-batch per rank at data-parallel
        size `dp` (its first micro-batch's gradients then wait beside the next one's activations)."""
        if self.job.kind == "rl":
            per_rank = self.rl.prompts_per_step * self.rl.samples_per_prompt / (dp * self.rl.mini_batches)
        elif self.job.kind == "sft":
            per_rank = self.train.batch_size / dp
        else:
            return False
        return per_rank > self.parallel.micro_batch_size



def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read, validate and return the job config at `path`; raises ConfigError naming the key.

    `overrides` are `section.key=value` strings (the CLI's --set); values are parsed as YAML, by the same
    reader and with the same limits as the file (rlslurm/safeyaml.py).
    """
    data = read_yaml(path)
    if data is None or data == {}:
        raise ConfigError(f"{path}: holds no job: the file is empty; a job config is a mapping of sections "
                          f"(job, cluster, model, ...), e.g. examples/tiny-grpo.yaml")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: holds no job: the top level must be a mapping of sections, not "
                          f"{type(data).__name__}")
    for item in overrides:
        apply_override(data, item, str(path))
    return load_mapping(JobConfig, data, source=str(path))


MAX_OVERRIDE_DEPTH = 4
"""Parts of a --set key path: section.key (reward.sandbox.cpu_s and diag.phase_timeouts_s.rollout have 3)."""
_KEY_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def apply_override(data: dict, item: str, source: str) -> None:
    """Set `a.b.c=value` inside the raw mapping; validation afterwards names the key as usual."""
    key, sep, raw = item.partition("=")
    shown = clip(item, 80)
    if not sep or not key.strip():
        raise ConfigError(f"{source}: --set {shown!r} must look like section.key=value")
    parts = key.strip().split(".")
    if len(parts) > MAX_OVERRIDE_DEPTH or not all(_KEY_PART.fullmatch(p) for p in parts):
        raise ConfigError(f"{source}: --set {shown!r}: {clip(key, 80)!r} is not a key path: section.key, made of "
                          f"names of letters, digits and '_' (at most {MAX_OVERRIDE_DEPTH} parts), e.g. train.steps")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:  # absent, or `section:` with nothing under it (the loader reads that as empty)
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: --set {shown!r}: {part} is not a section")
        node = child
    node[parts[-1]] = read_text(raw, f"{source}: --set {clip(key, 80)}")

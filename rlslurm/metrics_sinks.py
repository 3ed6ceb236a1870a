"""`logging:` in a job YAML: each step's metrics also where users look at runs, TensorBoard and Weights & Biases.

    logging:
      tensorboard: true        # <run>/tensorboard/ event files:  tensorboard --logdir <run>/tensorboard
      wandb: true              # offline, under <run>/wandb/:      wandb sync <run>/wandb/offline-run-*
      wandb_project: my-rl
      wandb_name: null         # null = the run directory's name

    metrics = MetricsLog(run, job.logging)   # rank 0 of the SFT and RL trainers
    metrics.append(record)                   # <run>/metrics.jsonl first, then each sink
    metrics.close()

metrics.jsonl stays the source of truth: every line is written there before any sink sees it, and a sink
that fails (a full disk, a broken package) is warned about once and dropped, never failing the step. The
sinks get the same names as the jsonl line, its numeric fields only (`step` is the x axis, `t` the wall
time). Compute nodes often have no internet, so Weights & Biases runs in offline mode (WANDB_MODE=offline)
and `wandb sync` uploads the run later from a login node.

A missing package is a config error (`rlslurm validate` and `submit` name the key and the pip command), not
a failure at step 1.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from rlslurm.configfile import FieldError, check_name, check_text
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)

PACKAGES = {"tensorboard": ("tensorboard", "pip install 'rlslurm[logging]' (or: pip install 'tensorboard>=2.15')"),
            "wandb": ("wandb", "pip install wandb")}
"""logging key -> (the module it imports, how to install it)."""


def installed(module: str) -> bool:
    """Whether `module` can be imported here (without importing it: wandb takes seconds)."""
    return importlib.util.find_spec(module) is not None


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    tensorboard: bool = False
    """Write each step's numeric metrics (metrics.jsonl's names) as TensorBoard event files under
    <run>/tensorboard/ (rank 0). Needs the tensorboard package: pip install 'rlslurm[logging]'."""
    wandb: bool = False
    """Log each step's numeric metrics to Weights & Biases in offline mode under <run>/wandb/ (rank 0); upload
    later with `wandb sync <run>/wandb/offline-run-*`. Needs the wandb package: pip install wandb."""
    wandb_project: str = "rlslurm"
    """The Weights & Biases project the run belongs to (1 to 64 letters, digits, '.', '_' or '-')."""
    wandb_name: str | None = None
    """The run's name in Weights & Biases; null = the run directory's name (job name and submit time)."""

    def __post_init__(self):
        check_name(self.wandb_project, "wandb_project", "it names the Weights & Biases project")
        check_text(self.wandb_name, "wandb_name", 128)
        for key in ("tensorboard", "wandb"):
            module, how = PACKAGES[key]
            if getattr(self, key) and not installed(module):
                raise FieldError(key, f"needs the {module} package, which {sys.executable} cannot import "
                                      f"(install it: {how})")


def numeric(record: dict) -> dict[str, float]:
    """The record's numeric fields a sink plots: ints and floats (not bools, not NaN/inf), without `step`
    and `t`, which are the axes."""
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "t") and isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v)}


class _TensorBoard:
    """Event files under <run>/tensorboard/; flushed every step, so a killed job keeps what it wrote. A
    requeued or resumed job writes a new file beside the old ones, purging their points from its first step
    on (the steps after the checkpoint it resumed from are made again), so each step shows once."""

    def __init__(self, run: RunDir, config: LoggingConfig, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (checked at load)

        self.writer = SummaryWriter(log_dir=str(run.path / "tensorboard"), purge_step=first_step)

    def write(self, step: int, values: dict[str, float], wall_time: float | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=wall_time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """An offline Weights & Biases run under <run>/wandb/; one id per run directory, so a requeued job's
    steps continue the same run when synced."""

    def __init__(self, run: RunDir, config: LoggingConfig, first_step: int):
        os.environ["WANDB_MODE"] = "offline"  # compute nodes often have no internet; `wandb sync` uploads later
        import wandb

        self.run = wandb.init(project=config.wandb_project, name=config.wandb_name or run.path.name,
                              id=_wandb_id(run.path.name), resume="allow", dir=str(run.path), mode="offline")

    def write(self, step: int, values: dict[str, float], wall_time: float | None) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_id(name: str) -> str:
    # W&B run ids may not hold '/', '\\', '#', '?', '%' or ':'; a run directory's name is letters, digits,
    # '.', '_' and '-', at most 128 characters.
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:128]


SINKS = {"tensorboard": _TensorBoard, "wandb": _WandB}


class MetricsLog:
    """Rank 0's writer of per-step metrics: <run>/metrics.jsonl first, then the sinks `logging:` turns on.

    Lifecycle: sinks open at the first `append` (a rank that never appends opens nothing); a sink that
    raises is warned about once and dropped; `close()` finishes the rest (safe to call twice)."""

    def __init__(self, run: RunDir, config: LoggingConfig):
        self.run = run
        self.config = config
        self.sinks: dict[str, Any] | None = None

    def append(self, record: dict) -> None:
        self.run.append_json(self.run.metrics, record)  # the source of truth, before any sink
        if self.sinks is None:
            self.sinks = {}
            for key, make in SINKS.items():
                if getattr(self.config, key):
                    try:
                        self.sinks[key] = make(self.run, self.config, int(record.get("step", 0)))
                    except Exception as e:  # noqa: BLE001 - a logger must never fail a training step
                        self._drop(key, e)
        if not self.sinks or "step" not in record:
            return
        values = numeric(record)
        for key, sink in list(self.sinks.items()):
            try:
                sink.write(int(record["step"]), values, record.get("t"))
            except Exception as e:  # noqa: BLE001
                self._drop(key, e)

    def close(self) -> None:
        for key, sink in list((self.sinks or {}).items()):
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                self._drop(key, e)
        self.sinks = {}

    def _drop(self, key: str, error: Exception) -> None:
        """Warn once, and send this sink nothing more."""
        log.warning("logging.%s: %s: %s; metrics.jsonl keeps every step, this sink is off for the rest of the job",
                    key, type(error).__name__, error)
        if self.sinks is not None:
            self.sinks.pop(key, None)

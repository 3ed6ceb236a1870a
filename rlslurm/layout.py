"""The job's layout, decided once at submit from the plan: where each component runs, how many engines,
and how new weights reach them.

    layout = JobLayout.decide(job, plan, backend="slurm")   # rlslurm submit / resume (rlslurm/launch.py)
    layout.write(run)                                       # <run>/layout.json
    layout = JobLayout.read(run)                            # every process of the job

`placement.mode: auto` and `sync.method: auto` are resolved by the planner alone (rlslurm/plan/report.py:
`_choose`, `_sync_method`); this record carries its answer to the processes of the job, so a job runs
exactly what `rlslurm plan` printed (tests/unit/test_layout.py, for every placement and sync method).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

from rlslurm.errors import PreflightError, RunDirError
from rlslurm.rundir import RunDir

Backend = Literal["slurm", "local"]
Placement = Literal["colocate", "separate"]
SyncMethod = Literal["disk", "broadcast", "ipc"]


@dataclass(frozen=True, kw_only=True)
class JobLayout:
    backend: Backend
    """slurm = one (heterogeneous) SLURM job; local = this machine through submitit's local executor."""
    placement: Placement
    """colocate = rollout shares the training nodes; separate = rollout on nodes of its own (the plan's choice)."""
    sync_method: SyncMethod
    """How new weights reach the engines each step (the plan's resolution of sync.method)."""
    train_nodes: int
    """Nodes of component 0 (trainer ranks; rank 0 is also the controller)."""
    train_tasks_per_node: int
    """Trainer ranks per node."""
    rollout_nodes: int
    """Nodes of the rollout component (0 = colocated: no rollout component)."""
    rollout_tasks_per_node: int
    """Engine servers per rollout node (one SLURM task each)."""
    engines: int
    """Rollout engines the controller uses."""
    reward_component: bool
    """The reward service runs as a het component of its own (reward.service = component)."""

    @property
    def train_world(self) -> int:
        """Trainer ranks in all."""
        return self.train_nodes * self.train_tasks_per_node

    @property
    def engines_from_component(self) -> bool:
        """The engines are the rollout het component's tasks, announced in <run>/endpoints/; otherwise
        (colocated, or any run off SLURM) the controller spawns them beside trainer rank 0."""
        return self.backend == "slurm" and self.rollout_nodes > 0

    @property
    def reward_from_component(self) -> bool:
        """The reward service is the reward het component's (announced in <run>/endpoints/reward.json);
        otherwise `reward.service: component` runs the same service beside the controller."""
        return self.backend == "slurm" and self.reward_component

    @classmethod
    def decide(cls, job, plan, backend: Backend) -> "JobLayout":
        """The layout of `job` as `plan` (rlslurm/plan/report.py's Plan of this very job) chose it."""
        hw, cl = job.hardware, job.cluster
        needs_rollout = job.job.kind in ("rl", "toy")
        rollout = plan.chosen.rollout_nodes if needs_rollout and plan.placement == "separate" else 0
        if needs_rollout and plan.placement == "separate" and rollout == 0:
            raise PreflightError("placement.mode = 'separate' but placement.rollout_nodes = 0: give rollout a node "
                                 "or set placement.mode: colocate")
        engines = job.rollout.engines if needs_rollout else 0
        return cls(backend=backend, placement=plan.placement, sync_method=plan.sync_method,
                   train_nodes=hw.nodes - rollout, train_tasks_per_node=cl.tasks_per_node or hw.gpus_per_node,
                   rollout_nodes=rollout, rollout_tasks_per_node=-(-engines // rollout) if rollout else 0,
                   engines=engines, reward_component=job.reward.service == "component")

    def write(self, run: RunDir) -> None:
        """<run>/layout.json, replaced atomically (a resume may decide another backend)."""
        tmp = run.layout.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(run.layout)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, run: RunDir) -> "JobLayout":
        """The layout submit decided for `run`; RunDirError when there is none (not started by rlslurm submit)."""
        try:
            return cls(**json.loads(run.layout.read_text()))
        except FileNotFoundError:
            raise RunDirError(f"{run.layout} is missing: the job's layout is decided by `rlslurm submit` "
                              "(rlslurm/launch.py); start the run through it") from None
        except (TypeError, ValueError) as e:
            raise RunDirError(f"{run.layout} is not a layout this rlslurm writes: {e}") from None

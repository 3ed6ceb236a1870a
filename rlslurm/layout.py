"""The job's layout, decided once at submit from the plan: where each component runs, how many engines,
how new weights reach them, and the GPUs of each component and task.

    layout = JobLayout.decide(job, plan, backend="slurm")   # rlslurm submit / resume (rlslurm/launch.py)
    layout.write(run)                                       # <run>/layout.json
    layout = JobLayout.read(run)                            # every process of the job

`placement.mode: auto` and `sync.method: auto` are resolved by the planner alone (rlslurm/plan/report.py:
`_choose`, `_sync_method`); this record carries its answer to the processes of the job, so a job runs
exactly what `rlslurm plan` printed (tests/unit/test_layout.py, for every placement and sync method).
The GPU numbers come from rlslurm/plan/gpus.py; rlslurm/devices.py turns them into each task's devices.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
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
    gpus_per_train_task: int = 0
    """GPUs of one trainer rank: 1 (its local rank's among the GPUs its node gives the job), 0 on the cpu profile."""
    gpus_per_engine: int = 0
    """GPUs of one engine, its own: rollout.tp, or 0 on the cpu profile."""
    train_gpus_per_node: int = 0
    """GPUs component 0 asks of SLURM per node (--gpus-per-node): one per trainer rank."""
    rollout_gpus_per_node: int = 0
    """GPUs the rollout component asks per node: engines per node x gpus_per_engine; its step binds each engine
    task to its own (srun --gpus-per-task)."""
    local_gpus: int = 0
    """GPUs of this machine a local run hands its tasks (submitit's gpus_per_node); 0 on SLURM."""
    spawned_engine_gpus: list[list[int]] = field(default_factory=list)
    """For each engine spawned beside trainer rank 0 (colocated, or any local run): the positions of its GPUs
    among those rank 0 sees (CUDA_VISIBLE_DEVICES). Colocated they are the trainer ranks' GPUs, time-shared;
    in a local run of separate placement they follow the trainer ranks'."""

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
        tasks_per_node = cl.tasks_per_node or hw.gpus_per_node
        gpus = plan.gpus
        train_world = (hw.nodes - rollout) * tasks_per_node
        # Engines spawned by the RL job's rank 0: colocated they time-share the trainers' GPUs from the first;
        # off SLURM, separate, they take this machine's GPUs after the trainer ranks'.
        spawned = job.job.kind == "rl" and not (backend == "slurm" and rollout > 0)
        first = train_world if backend == "local" and rollout > 0 else 0
        spawned_gpus = ([list(range(first + i * gpus.per_engine, first + (i + 1) * gpus.per_engine))
                         for i in range(engines)] if spawned and gpus.per_engine else [])
        local = 0
        if backend == "local" and gpus.asked:
            local = max([train_world] + [p + 1 for ps in spawned_gpus for p in ps])
        return cls(backend=backend, placement=plan.placement, sync_method=plan.sync_method,
                   train_nodes=hw.nodes - rollout, train_tasks_per_node=tasks_per_node,
                   rollout_nodes=rollout, rollout_tasks_per_node=-(-engines // rollout) if rollout else 0,
                   engines=engines, reward_component=job.reward.service == "component",
                   gpus_per_train_task=gpus.per_train_task, gpus_per_engine=gpus.per_engine,
                   train_gpus_per_node=gpus.train_per_node,
                   rollout_gpus_per_node=gpus.rollout_per_node if rollout else 0, local_gpus=local,
                   spawned_engine_gpus=spawned_gpus)

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

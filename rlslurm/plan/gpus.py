"""The job's GPUs: how many each component asks of SLURM per node, how many each task takes, and the check
that no node is asked for more than it has.

    gpus = gpu_plan(job, plan.placement, plan.chosen.rollout_nodes)
    gpus.train_per_node, gpus.rollout_per_node, gpus.per_engine
    gpus.problems        # pre-flight (plan/report.py): a node asked for more GPUs than hardware.gpus_per_node

Every trainer rank takes one GPU, its local rank's among its node's; every engine takes rollout.tp GPUs of
its own, so two engines never share one. Colocated engines (spawned beside trainer rank 0) time-share the
trainer ranks' GPUs of that node, engine i on GPUs i x tp ... (i + 1) x tp - 1. The reward service takes
none. The cpu profile asks for none at all: worker processes stand in for GPUs there.
rlslurm/layout.py carries these numbers to the job (rlslurm/devices.py reads them in each task).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GpuPlan:
    """GPUs per node and per task of one job under its chosen placement."""

    asked: bool
    """The job asks SLURM (or this machine) for GPUs: any hardware.profile but cpu."""
    per_train_task: int
    """GPUs of one trainer rank (1, or 0 when none are asked)."""
    per_engine: int
    """GPUs of one engine (rollout.tp, or 0 when none are asked)."""
    train_per_node: int
    """GPUs a node of component 0 is asked for (--gpus-per-node): one per trainer rank on it."""
    engines_per_node: int
    """Engines on one rollout node (separate), or beside trainer rank 0 (colocated)."""
    rollout_per_node: int
    """GPUs a rollout node is asked for: engines_per_node x per_engine (0 when colocated)."""
    problems: tuple[str, ...]
    """A node asked for more GPUs than hardware.gpus_per_node, each naming the keys and the numbers."""

    def text(self) -> str:
        """One line of `rlslurm plan`."""
        if not self.asked:
            return "GPUs: none asked (hardware.profile cpu: worker processes stand in for GPUs)"
        parts = [f"train {self.train_per_node} per node (1 per rank, its local rank's)"]
        if self.rollout_per_node:
            parts.append(f"rollout {self.rollout_per_node} per node ({self.engines_per_node} engine(s) x "
                         f"rollout.tp {self.per_engine}, each its own)")
        elif self.engines_per_node:
            parts.append(f"{self.engines_per_node} colocated engine(s) x rollout.tp {self.per_engine} time-share "
                         "trainer rank 0's node's, each its own")
        return "GPUs: " + "; ".join(parts + ["reward none"])

    def as_dict(self) -> dict:
        return {"asked": self.asked, "per_train_task": self.per_train_task, "per_engine": self.per_engine,
                "train_per_node": self.train_per_node, "engines_per_node": self.engines_per_node,
                "rollout_per_node": self.rollout_per_node}


def asks_gpus(job) -> bool:
    """Whether the job asks for GPUs: the cpu profile's 'GPUs' are worker processes, every other is a GPU."""
    return job.hardware.profile != "cpu"


def gpu_plan(job, placement: Literal["colocate", "separate"], rollout_nodes: int) -> GpuPlan:
    """The GPUs of `job` with rollout `placement` on `rollout_nodes` nodes (the plan's choice)."""
    hw, kind = job.hardware, job.job.kind
    asked = asks_gpus(job)
    tasks = job.cluster.tasks_per_node or hw.gpus_per_node
    tp = job.rollout.tp
    separate = placement == "separate" and rollout_nodes > 0 and kind in ("rl", "toy")
    # Colocated engines are spawned by the RL job's rank 0; the toy job has rollout tasks only as a component.
    if separate:
        engines_per_node = -(-job.rollout.engines // rollout_nodes)
    else:
        engines_per_node = job.rollout.engines if kind == "rl" else 0
    problems: list[str] = []
    if asked and tasks > hw.gpus_per_node:
        problems.append(f"GPUs: {tasks} trainer ranks per node (cluster.tasks_per_node) ask {tasks} GPUs of a node, "
                        f"but hardware.gpus_per_node = {hw.gpus_per_node}")
    if asked and engines_per_node * tp > hw.gpus_per_node:
        if separate:
            problems.append(
                f"GPUs: rollout.engines = {job.rollout.engines} on {rollout_nodes} rollout node(s) is "
                f"{engines_per_node} engine(s) of rollout.tp = {tp} per node, {engines_per_node * tp} GPUs of their "
                f"own, but hardware.gpus_per_node = {hw.gpus_per_node}: lower rollout.engines or rollout.tp, or "
                "give rollout more nodes (placement.rollout_nodes)")
        else:
            problems.append(
                f"GPUs: rollout.engines = {job.rollout.engines} of rollout.tp = {tp} colocated beside trainer rank 0 "
                f"need {engines_per_node * tp} GPUs of their own on its node, but hardware.gpus_per_node = "
                f"{hw.gpus_per_node} (two engines would share one): lower rollout.engines or rollout.tp, or set "
                "placement.mode: separate")
    return GpuPlan(asked=asked, per_train_task=1 if asked else 0, per_engine=tp if asked else 0,
                   train_per_node=tasks if asked else 0, engines_per_node=engines_per_node,
                   rollout_per_node=engines_per_node * tp if asked and separate else 0, problems=tuple(problems))

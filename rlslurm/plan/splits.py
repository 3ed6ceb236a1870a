"""Every split of the cluster between training and rollout nodes, its memory verdict, and the advice.

For r = 0 .. nodes-1 rollout nodes the trainer keeps (nodes - r) x gpus_per_node GPUs. Fewer training
GPUs shrink DP and with it the expert-DP group (DP / EP) that shards the expert optimizer state, so the
memory per GPU *rises* as nodes leave for rollout (the lecture: 85.7 -> 88.3 -> 92.7 -> 101.4 GB, OOM).
The advice is the most rollout nodes whose split is ok or tight and breaks no divisibility rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlslurm.modelspec import ParamCounts
from rlslurm.plan.calibration import Calibration
from rlslurm.plan.compute import DeviceSpeed, train_seconds
from rlslurm.plan.lora import job_adapter_params
from rlslurm.plan.memory import TrainerMemory, trainer_memory
from rlslurm.plan.parallel import Rule, data_parallel, rollout_rules, world_rules
from rlslurm.plan.quantity import Q
from rlslurm.plan.recompute import recompute_scale
from rlslurm.plan.steptime import train_step_s

if TYPE_CHECKING:  # config.py imports this package's config classes: no cycle at run time
    from rlslurm.config import JobConfig

RUNNABLE = ("ok", "tight")


@dataclass(frozen=True)
class Split:
    """One split: GPUs on each side, broken rules, and (when the layout is valid) the trainer's memory."""

    rollout_nodes: int
    train_gpus: int
    rollout_gpus: int
    broken: tuple[Rule, ...]
    memory: TrainerMemory | None
    train_step: Q

    @property
    def verdict(self) -> str:
        """ok / tight / not advised / OOM, or `invalid` when a divisibility rule breaks."""
        if self.broken or self.memory is None:
            return "invalid"
        return self.memory.verdict

    @property
    def runnable(self) -> bool:
        return self.verdict in RUNNABLE


def split(job: "JobConfig", counts: ParamCounts, rollout_nodes: int, speed: DeviceSpeed,
          calibration: Calibration | None = None) -> Split:
    """The split with `rollout_nodes` nodes given to rollout (0 = every GPU trains: colocation). Its train step
    is timing.train_step_s scaled to its GPUs when measured, else counted (rlslurm/plan/compute.py) and scaled by
    a run's measured / planned (`calibration`)."""
    hw, p = job.hardware, job.parallel
    train_gpus = (hw.nodes - rollout_nodes) * hw.gpus_per_node
    rollout_gpus = rollout_nodes * hw.gpus_per_node
    world_broken = world_rules(p, train_gpus)
    broken = tuple(world_broken + rollout_rules(rollout_gpus, job.rollout.tp))
    memory = None
    dp = data_parallel(p, train_gpus) if not world_broken else max(1, train_gpus // (p.tp * p.pp * p.cp))
    cal = calibration
    if not world_broken:
        memory = trainer_memory(counts, job.model, p, job.resolved_memory, hw.gpu_mem_gb, dp,
                                backend=job.train.backend, accumulates=job.accumulates(dp),
                                act_scale=cal.activations if cal else None, run=cal.run if cal else "",
                                adapters=job_adapter_params(job))
    if job.timing.train_step_s is not None:
        step = train_step_s(job.timing, train_gpus, hw.total_gpus, recompute_scale(job.model, p, job.resolved_memory))
    else:
        step = train_seconds(job, counts, dp, speed)
        if cal and cal.train is not None:
            step = Q(step.label, step.value * cal.train, "s",
                     f"({step.how}) x measured/planned {cal.train:.3g} ({cal.run})")
    return Split(rollout_nodes, train_gpus, rollout_gpus, broken, memory, step)


def all_splits(job: "JobConfig", counts: ParamCounts, speed: DeviceSpeed,
               calibration: Calibration | None = None) -> list[Split]:
    """Splits from 0 rollout nodes (all train) to nodes - 1 (one node keeps training)."""
    return [split(job, counts, r, speed, calibration) for r in range(job.hardware.nodes)]


def recommend(splits: list[Split]) -> int | None:
    """Most rollout nodes whose split is ok or tight; None when no split runs at all."""
    runnable = [s.rollout_nodes for s in splits if s.runnable]
    return max(runnable) if runnable else None


def advice(splits: list[Split], gpus_per_node: int) -> str:
    """The recommendation in a sentence, with the reason the next node cannot leave."""
    best = recommend(splits)
    if best is None:
        return "no split fits: even with every GPU training the trainer does not fit (see the table)"
    if best == 0:
        head = "no node can leave training for rollout: colocate (time-share the GPUs)"
    else:
        head = f"at most {best} node(s) ({best * gpus_per_node} GPUs) can leave training for rollout"
    following = next((s for s in splits if s.rollout_nodes == best + 1), None)
    if following is None:
        return head
    if following.memory is not None and following.verdict != "invalid":
        why = (f"{following.rollout_nodes} would leave {following.memory.headroom_pct.value:.1f} % headroom "
               f"({following.verdict}: peak {following.memory.peak.text()})")
    else:
        why = f"{following.rollout_nodes} break(s): " + "; ".join(r.message for r in following.broken)
    return f"{head}; {why}"

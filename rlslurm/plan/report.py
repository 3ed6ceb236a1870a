"""The plan of one job: every figure `rlslurm plan` prints, and the checks `rlslurm submit` runs on it.

    plan = build_plan(load_config("examples/lecture-h20.yaml"))
    print(render_text(plan, explain=True))      # tables; --explain adds each number's terms
    problems = preflight(plan)                  # non-empty: submit refuses, naming each reason

"What can be computed must not be guessed": memory per split, divisibility, colocate vs. separate,
rollout capacity and decode roofline, weight-sync time per method, step split, checkpoint interval.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rlslurm.config import JobConfig
from rlslurm.modelspec import ParamCounts, param_counts
from rlslurm.plan.checkpoint_interval import Interval, checkpoint_interval
from rlslurm.plan.decode import (KVCache, RolloutCapacity, capacity, kv_cache, roofline, roofline_by_profile,
                                 weights_gb)
from rlslurm.plan.gpus import GpuPlan, gpu_plan
from rlslurm.plan.memory import TrainerMemory, trainer_memory
from rlslurm.plan.parallel import Rule, static_rules
from rlslurm.plan.placement import Colocate, colocate, stated_placement
from rlslurm.plan.quantity import Q
from rlslurm.plan.splits import Split, advice, all_splits, recommend
from rlslurm.plan.steptime import (Amortisation, RewardPhase, StepSplit, SyncMethod, amortise, reward_phase,
                                   step_splits, sync_times)


@dataclass(frozen=True)
class Plan:
    """Everything the planner computed for one job config; render_text / render_json show it."""

    job: JobConfig
    counts: ParamCounts
    splits: list[Split]
    static_broken: list[Rule]
    recommended_rollout_nodes: int | None
    advice: str
    placement: Literal["colocate", "separate"]
    chosen: Split
    fused_ce_what_if: TrainerMemory | None
    colocate: Colocate
    weights: Q
    kv: KVCache
    rollout: RolloutCapacity | None
    roofline: Q
    roofline_profiles: dict[str, Q]
    syncs: dict[SyncMethod, Q]
    sync_method: SyncMethod
    reward: RewardPhase
    steps: list[StepSplit]
    amortisation: list[Amortisation]
    checkpoint: Interval
    checkpoint_step_s: Q
    checkpoint_cap_s: float
    rl_step_s: Q
    warnings: list[str]

    @property
    def gpus(self) -> GpuPlan:
        """GPUs per node and per task under the chosen placement (rlslurm/plan/gpus.py)."""
        return gpu_plan(self.job, self.placement, self.chosen.rollout_nodes)

    @property
    def chosen_step(self) -> StepSplit:
        """The step split of the chosen placement and sync method."""
        for row in self.steps:
            if row.method == self.sync_method and row.placement == self.placement:
                return row
        return self.steps[0]


def _choose(job: JobConfig, splits: list[Split], best: int | None) -> tuple[Literal["colocate", "separate"], Split]:
    """The placement and split: as the config states it, else (placement.mode auto) by the numbers."""
    pl = job.placement
    stated = stated_placement(pl)
    if stated == "colocate":
        return "colocate", splits[0]
    if pl.rollout_nodes is not None and pl.rollout_nodes > 0:
        return "separate", splits[pl.rollout_nodes]
    if stated == "separate":
        # Nothing can leave training: keep the split whose problems preflight will name.
        return "separate", splits[best] if best else splits[min(1, len(splits) - 1)]
    return ("separate", splits[best]) if best else ("colocate", splits[0])


def build_plan(job: JobConfig) -> Plan:
    """Compute the whole plan; pure arithmetic on the config (no cluster, no GPU)."""
    hw, m = job.hardware, job.model
    counts = param_counts(m)
    splits = all_splits(job, counts)
    best = recommend(splits)
    placement, chosen = _choose(job, splits, best)
    fused = None
    # The what-if is worth a line only when the logits are a real share (>= 1 %) of the GPU's memory.
    if (chosen.memory is not None and not job.memory.fused_ce
            and chosen.memory.activations.logits.value >= 0.01 * hw.gpu_mem_gb):
        with_fused = dataclasses.replace(job.memory, fused_ce=True)
        fused = trainer_memory(counts, m, job.parallel, with_fused, hw.gpu_mem_gb, chosen.memory.dp)
    weights = weights_gb(counts, job.sync.weights_gb)
    kv = kv_cache(m, job.rollout)
    colo = colocate(splits[0].memory, hw, job.rollout, kv, weights, job.placement)
    cap = None
    if placement == "separate" and chosen.rollout_gpus:
        cap = capacity(weights, kv, hw, job.rollout, chosen.rollout_gpus, job.placement.engine_overhead_gb)
    syncs = sync_times(weights, hw)
    sync_method = job.sync.resolved_method(placement)
    reward = reward_phase(job.rl, job.reward, job.timing)
    offload_s = 0.0 if colo.fits_without_offload or colo.train_verdict == "invalid" else colo.offload_per_step_s.value
    separate_train = chosen.train_step if placement == "separate" else None
    steps = step_splits(job.timing, reward.used.value, separate_train, splits[0].train_step, syncs, offload_s)
    amort = amortise(syncs, offload_s, job.timing.total_steps, hw.total_gpus)
    plan_step = next((r for r in steps if r.method == sync_method and r.placement == placement), steps[0])
    rl_step = Q("RL step", plan_step.total_s, "s",
                f"rollout {plan_step.rollout_s:g} + reward {plan_step.reward_s:g} + train {plan_step.train_s:.1f} "
                f"+ sync {plan_step.sync_s:.2f} ({sync_method}) + offload {plan_step.offload_s:.2f}")
    ck = job.checkpoint
    # The interval must fit in one allocation: the signal before the time limit ends useful work.
    wall_s = float(job.cluster.time_limit_min * 60 - job.cluster.signal_before_s)
    # Young/Daly count in seconds of work; the lecture's 77 steps are training steps of timing.train_step_s.
    ck_step = Q("checkpoint step", job.timing.train_step_s, "s", "timing.train_step_s")
    interval = checkpoint_interval(ck.cost_s, ck.mtbf_h * 3600, ck_step.value, wall_s)
    plan = Plan(job, counts, splits, static_rules(job.parallel, m.layers, m.heads, m.n_kv_heads, m.experts,
                                                  hw.gpus_per_node, job.rollout.tp),
                best, advice(splits, hw.gpus_per_node), placement, chosen, fused, colo, weights, kv, cap,
                roofline(counts.active, hw.hbm_tb_s), roofline_by_profile(counts.active), syncs, sync_method,
                reward, steps, amort, interval, ck_step, wall_s, rl_step, [])
    plan.warnings.extend(_warnings(plan))
    return plan


def _warnings(plan: Plan) -> list[str]:
    out = []
    c = plan.chosen
    if c.verdict in ("tight", "not advised") and c.memory is not None:
        out.append(f"{c.train_gpus} training GPUs leave {c.memory.headroom_pct.value:.1f} % headroom ({c.verdict}): "
                   "one long sample can OOM")
    if plan.placement == "colocate" and plan.sync_method != "ipc" and not _nccl_on_one_gpu(plan):
        out.append(f"sync.method = {plan.sync_method!r} while colocated: ipc would be "
                   f"{plan.syncs[plan.sync_method].value - plan.syncs['ipc'].value:.1f} s faster per step")
    if plan.reward.used.value > plan.chosen.train_step.value:
        out.append(f"the reward phase ({plan.reward.used.text()}) is longer than training "
                   f"({plan.chosen.train_step.text()}): raise reward.concurrency")
    return out


def _nccl_on_one_gpu(plan: Plan) -> bool:
    """Broadcast sync between trainer rank 0 and colocated engines on a GPU cluster: one NCCL group with two
    ranks on one device (rlslurm/rl/engines.py spawns colocated engines in rank 0's environment, on its GPU). On the
    cpu profile the group is gloo, which has no such rule."""
    return plan.placement == "colocate" and plan.sync_method == "broadcast" and plan.job.hardware.profile != "cpu"


def preflight(plan: Plan) -> list[str]:
    """Reasons `rlslurm submit` must refuse this job (empty = go): OOM, broken rules, no room for rollout."""
    problems = [r.message for r in plan.static_broken]
    c = plan.chosen
    where = f"{plan.placement}, {c.train_gpus} training GPUs"
    problems += [f"{where}: {r.message}" for r in c.broken]
    if c.memory is not None and c.verdict == "OOM":
        problems.append(f"{where}: trainer OOM, peak {c.memory.peak.text()} > {plan.job.hardware.gpu_mem_gb:g} GB "
                        f"per GPU ({c.memory.peak.how})")
    if plan.job.placement.mode == "separate" and not c.rollout_gpus:
        problems.append("placement.mode = 'separate' but no node can leave training: " + plan.advice)
    colo = plan.colocate
    if plan.placement == "colocate" and c.verdict != "OOM" and not colo.fits_without_offload:
        if not plan.job.placement.offload:
            problems.append(f"colocate without offload: the engine needs {colo.engine_need_gb.text()} but the "
                            f"training peak leaves {colo.free_gb.text()}; set placement.offload: true")
        elif not colo.host_ram_fits:
            problems.append(f"colocate with offload needs {colo.host_ram_per_node_gb.text()} host RAM per node "
                            f"> hardware.host_ram_gb = {plan.job.hardware.host_ram_gb:g}")
    if plan.placement == "separate" and plan.sync_method == "ipc":
        problems.append("sync.method = 'ipc' needs colocation (engines on other nodes cannot map the trainer's "
                        "memory), and the plan places rollout separate: set placement.mode: colocate, or "
                        "sync.method: broadcast or disk")
    if _nccl_on_one_gpu(plan):
        problems.append("sync.method = 'broadcast' with placement colocate on GPUs: the engines start beside trainer "
                        "rank 0 and share its GPU, and NCCL refuses two ranks of one group on one GPU ('Duplicate "
                        "GPU detected'); set sync.method: ipc (the same GPU's memory, no copy) or disk, or "
                        "placement.mode: separate")
    problems += list(plan.gpus.problems)
    if plan.rollout is not None and plan.rollout.seqs_per_engine.value < 1:
        problems.append(f"rollout: one engine's KV space {plan.rollout.kv_space_per_gpu.text()} per GPU holds no "
                        f"sequence of rollout.max_seq_len = {plan.job.rollout.max_seq_len}")
    return problems


def render_text(plan: Plan, explain: bool = False) -> str:
    """The human view (see rlslurm/plan/render.py)."""
    from rlslurm.plan.render import text
    return text(plan, preflight(plan), explain)


def render_json(plan: Plan) -> str:
    """The machine view: every number with its unit in the key (see rlslurm/plan/render.py)."""
    from rlslurm.plan.render import as_json
    return as_json(plan, preflight(plan))

"""The plan of one job: every figure `rlslurm plan` prints, and the checks `rlslurm submit` runs on it.

    plan = build_plan(load_config("examples/lecture-h20.yaml"))
    print(render_text(plan, explain=True))      # rlslurm/plan/render.py: tables; --explain adds each number's terms
    problems = preflight(plan)                  # non-empty: submit refuses, naming each reason

"What can be computed must not be guessed": memory per split, divisibility, colocate vs. separate,
rollout capacity and decode roofline, weight-sync time per method, step split, checkpoint interval.
The choice is the step time's: among the options the config leaves open (placement.mode, rollout_nodes,
sync.method; `auto` leaves all) and the job can run (rlslurm/plan/options.py), the fastest; the job runs
exactly that (rlslurm/layout.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

from rlslurm.config import JobConfig
from rlslurm.modelspec import ParamCounts, param_counts
from rlslurm.plan.calibration import Calibration
from rlslurm.plan.checkpoint_interval import Interval, checkpoint_interval
from rlslurm.plan.compute import DeviceSpeed, device_speed, rollout_seconds
from rlslurm.plan.decode import KVCache, RolloutCapacity, kv_cache, roofline, roofline_by_profile, weights_gb
from rlslurm.plan.gpus import GpuPlan, gpu_plan
from rlslurm.plan.lora import job_adapter_params, sync_weights as lora_sync_weights
from rlslurm.plan.memory import TrainerMemory, trainer_memory
from rlslurm.plan.options import PLACEMENTS, Option, Placement, all_options, option
from rlslurm.plan.parallel import Rule, static_rules, trainer_rules
from rlslurm.plan.placement import Colocate, colocate, stated_placement
from rlslurm.plan.quantity import Q, num
from rlslurm.plan.recompute import MODES, forward_flops, recompute_factor, recompute_scale
from rlslurm.plan.splits import Split, advice, all_splits, recommend
from rlslurm.plan.steptime import Amortisation, RewardPhase, StepSplit, SyncMethod, amortise, reward_phase, sync_times
from rlslurm.plan.timeouts import Chain, timeout_chain


@dataclass(frozen=True)
class Plan:
    """Everything the planner computed for one job config; render.py's render_text / render_json show it."""

    job: JobConfig
    counts: ParamCounts
    splits: list[Split]
    static_broken: list[Rule]
    recommended_rollout_nodes: int | None
    advice: str
    options: list[Option]
    option: Option
    """The chosen option: the fastest the job can run among those the config leaves open."""
    fused_ce_what_if: TrainerMemory | None
    colocate: Colocate
    weights: Q
    kv: KVCache
    roofline: Q
    roofline_profiles: dict[str, Q]
    syncs: dict[SyncMethod, Q]
    reward: RewardPhase
    recompute: list[Q]
    """Forward FLOPs per token and each recompute mode's step-time factor (`--explain`)."""
    amortisation: list[Amortisation]
    checkpoint: Interval
    checkpoint_step_s: Q
    checkpoint_cap_s: float
    rl_step_s: Q
    warnings: list[str]
    speed: DeviceSpeed
    """The device speed the step times are counted at (rlslurm/plan/compute.py)."""
    rollout_s: Q
    """One step's rollout: timing.rollout_s, else counted (and calibrated)."""
    checkpoint_cost_s: float
    """C of the Young/Daly interval: checkpoint.cost_s, or a run's measured cost scaled to this model."""
    calibration: Calibration | None = None
    """The run whose measurements scale this plan's terms (`rlslurm plan --from-run`), if any."""

    @property
    def placement(self) -> Placement:
        return self.option.placement

    @property
    def chosen(self) -> Split:
        """The split of the chosen option (colocation: every GPU trains)."""
        return self.option.split

    @property
    def sync_method(self) -> SyncMethod:
        return self.option.method

    @property
    def rollout(self) -> RolloutCapacity | None:
        """The engines' capacity on the chosen split's rollout GPUs (None when colocated)."""
        return self.option.rollout

    @property
    def gpus(self) -> GpuPlan:
        """GPUs per node and per task under the chosen placement (rlslurm/plan/gpus.py)."""
        return gpu_plan(self.job, self.placement, self.chosen.rollout_nodes)

    @property
    def chosen_step(self) -> StepSplit:
        """The step split of the chosen placement and sync method."""
        return self.option.step

    @property
    def steps(self) -> list[StepSplit]:
        """The step of every sync method at the chosen split and colocated (the lecture's question 2)."""
        return [o.step for o in self.options if o.split is self.chosen or o.placement == "colocate"]

    def alternatives(self) -> tuple[Option | None, Option | None]:
        """(the fastest other option the config allows and the job can run, the fastest option faster than the
        chosen one that the plan could not choose: not runnable, not advised, or excluded by the config)."""
        chosen, allowed = self.option, _allowed_options(self.job, self.options)
        others = [o for o in allowed if o is not chosen and o.runnable]
        faster = [o for o in self.options if o is not chosen and o.step.total_s < chosen.step.total_s
                  and o.split.verdict != "OOM" and not (o.advised and o in allowed)]
        # The advised first (what the plan would take next), and among faster ones those that could run.
        def first(xs: list[Option]) -> Option | None:
            return min(xs, key=lambda o: (not o.runnable, not o.advised, o.step.total_s)) if xs else None

        return first(others), first(faster)

    def excluded_by(self, o: Option) -> str | None:
        """The config setting that keeps option `o` out of the choice (None: the config allows it)."""
        if o in _allowed_options(self.job, self.options):
            return None
        pairs, pl, sync = dict(_allowed(self.job)), self.job.placement, self.job.sync
        if o.placement not in pairs:
            return f"placement.mode = {pl.mode!r}" if pl.mode in PLACEMENTS else \
                f"placement.rollout_nodes = {pl.rollout_nodes}"
        if pairs[o.placement] != o.method:
            resolved = pairs[o.placement]
            return f"sync.method = {sync.method!r}" + (f" ({resolved} when {o.placement}d)"
                                                        if resolved != sync.method else "")
        return f"placement.rollout_nodes = {pl.rollout_nodes}"


def _allowed(job: JobConfig) -> list[tuple[Placement, SyncMethod]]:
    """The (placement, sync method) pairs the config leaves open: the placement it states
    (rlslurm/plan/placement.py `stated_placement`), else both, each with the method SyncConfig.resolved_method
    runs under it (the one place sync.method auto is resolved)."""
    stated = stated_placement(job.placement)
    return [(p, job.sync.resolved_method(p)) for p in ((stated,) if stated else PLACEMENTS)]


def _allowed_options(job: JobConfig, options: list[Option]) -> list[Option]:
    """The options the config leaves open: placement.mode, placement.rollout_nodes, sync.method."""
    pairs, nodes = _allowed(job), job.placement.rollout_nodes or None
    return [o for o in options if (o.placement, o.method) in pairs
            and (o.placement == "colocate" or not nodes or o.split.rollout_nodes == nodes)]


def _choose(job: JobConfig, options: list[Option], fallback) -> Option:
    """The fastest option the job can run among those the config allows (placement.mode, rollout_nodes,
    sync.method); a split whose headroom is `not advised` only when no other one runs. When none runs, the
    option with the fewest blockers: its pre-flight names them."""
    allowed = _allowed_options(job, options)
    if not allowed:  # placement.mode: separate on one node: nothing can leave training
        allowed = [fallback(method) for placement, method in _allowed(job) if placement == "separate"]
    runnable = [o for o in allowed if o.advised] or [o for o in allowed if o.runnable]
    if runnable:
        return min(runnable, key=lambda o: o.step.total_s)
    return min(allowed, key=lambda o: (len(o.blockers), o.step.total_s))


def build_plan(job: JobConfig, calibration: Calibration | None = None) -> Plan:
    """Compute the whole plan; arithmetic on the config and the device's speed (a GPU profile's vendor figures,
    or this machine's, measured once: rlslurm/plan/machine.py), each term scaled by a run's measured / planned
    where `calibration` holds one (`rlslurm plan --from-run`)."""
    hw, m, cal = job.hardware, job.model, calibration
    counts = param_counts(m)
    speed = device_speed(hw, job.timing.mfu)
    splits = all_splits(job, counts, speed, cal)
    best = recommend(splits)
    how = advice(splits, hw.gpus_per_node)
    weights = weights_gb(counts, job.sync.weights_gb)
    kv = kv_cache(m, job.rollout)
    colo = colocate(splits[0].memory, hw, job.rollout, kv, weights, job.placement)
    run = cal.run if cal else ""
    syncs = sync_times(lora_sync_weights(weights, job), hw, cal.sync_overhead_s or 0.0 if cal else 0.0, run)
    reward = reward_phase(job.rl, job.reward, job.timing, cal.reward_s_per_response if cal else None, run,
                          task_rule_inline=job.reward.service == "inline" and job.data.train is None)
    rollout = _rollout(job, counts, speed, cal)
    idle_s = cal.idle_s or 0.0 if cal else 0.0
    make = partial(option, job, colo=colo, syncs=syncs, reward_s=reward.used.value, kv=kv, weights=weights,
                   advice=how, rollout_s=rollout.value, idle_s=idle_s)
    options = all_options(job, splits, colo, syncs, reward.used.value, kv, weights, how, rollout.value, idle_s)
    chosen = _choose(job, options, lambda method: make("separate", splits[0], method))
    fused = None
    mem = chosen.split.memory
    # The what-if is worth a line only when the logits are a real share (>= 1 %) of the GPU's memory.
    if mem is not None and not job.memory.fused_ce and mem.activations.logits.value >= 0.01 * hw.gpu_mem_gb:
        with_fused = dataclasses.replace(job.resolved_memory, fused_ce=True)
        fused = trainer_memory(counts, m, job.parallel, with_fused, hw.gpu_mem_gb, mem.dp, backend=job.train.backend,
                               accumulates=job.accumulates(mem.dp), adapters=job_adapter_params(job))
    offload_s = 0.0 if colo.fits_without_offload or colo.train_verdict == "invalid" else colo.offload_per_step_s.value
    amort = amortise(syncs, offload_s, job.timing.total_steps, hw.total_gpus)
    step = chosen.step
    idle = f" + idle {step.idle_s:.3g} (measured: {run})" if step.idle_s else ""
    busy = (f"max(rollout {num(step.rollout_s)} + reward {num(step.reward_s)}, train {num(step.train_s)}: "
            f"rl.max_staleness {job.rl.max_staleness}, side by side)" if step.overlapped else
            f"rollout {num(step.rollout_s)} + reward {num(step.reward_s)} + train {num(step.train_s)}")
    rl_step = Q("RL step", step.total_s, "s",
                f"{busy} + sync {num(step.sync_s)} ({step.method}) + offload {step.offload_s:.2f}{idle}")
    flops = forward_flops(m, job.parallel)
    recompute = [flops.layer_matmuls, flops.core_attention, flops.head, flops.total,
                 *(recompute_factor(m, job.parallel, mode) for mode in MODES),
                 recompute_scale(m, job.parallel, job.resolved_memory)]
    ck = job.checkpoint
    # The interval must fit in one allocation: the signal before the time limit ends useful work.
    wall_s = float(job.cluster.time_limit_min * 60 - job.cluster.signal_before_s)
    # Young/Daly count in seconds of work; the lecture's 77 steps are training steps of timing.train_step_s.
    if job.timing.train_step_s is not None:
        ck_step = Q("checkpoint step", job.timing.train_step_s, "s", "timing.train_step_s")
    else:
        ck_step = Q("checkpoint step", chosen.split.train_step.value, "s", "the chosen split's train step")
    cost_s = ck.cost_s
    if cal and cal.checkpoint_s_per_gparam is not None and not _set(job.checkpoint, "cost_s"):
        cost_s = cal.checkpoint_s_per_gparam * counts.total / 1e9
    interval = checkpoint_interval(cost_s, ck.mtbf_h * 3600, ck_step.value, wall_s)
    plan = Plan(job, counts, splits, static_rules(job.parallel, m.layers, m.heads, m.n_kv_heads, m.experts,
                                                  hw.gpus_per_node, job.rollout.tp),
                best, how, options, chosen, fused, colo, weights, kv, roofline(counts.active, hw.hbm_tb_s),
                roofline_by_profile(counts.active), syncs, reward, recompute, amort, interval, ck_step, wall_s,
                rl_step, [], speed, rollout, cost_s, cal)
    plan.warnings.extend(_warnings(plan))
    return plan


def _rollout(job: JobConfig, counts: ParamCounts, speed: DeviceSpeed, cal: Calibration | None) -> Q:
    """timing.rollout_s as measured, else counted over the job's engines, scaled by a run's measured / planned."""
    if job.timing.rollout_s is not None:
        return Q("rollout", job.timing.rollout_s, "s", "timing.rollout_s")
    if job.job.kind != "rl":
        return Q("rollout", 0.0, "s", f"job.kind = {job.job.kind!r}: no rollout")
    counted = rollout_seconds(job, counts, job.rollout.engines, speed)
    if cal and cal.rollout is not None:
        return Q("rollout", counted.value * cal.rollout, "s",
                 f"({counted.how}) x measured/planned {cal.rollout:.3g} ({cal.run})")
    return counted


def _set(config, name: str) -> bool:
    """Whether `config.name` differs from its default (a value the user wrote wins over a calibration)."""
    f = next(f for f in dataclasses.fields(config) if f.name == name)
    return getattr(config, name) != f.default


def _warnings(plan: Plan) -> list[str]:
    out = []
    c = plan.chosen
    if c.verdict in ("tight", "not advised") and c.memory is not None:
        out.append(f"{c.train_gpus} training GPUs leave {c.memory.headroom_pct.value:.1f} % headroom ({c.verdict}): "
                   "one long sample can OOM")
    gpu_broadcast = plan.sync_method == "broadcast" and plan.job.hardware.profile != "cpu"
    saved = plan.syncs[plan.sync_method].value - plan.syncs["ipc"].value
    # Worth a line when it is 1 % of the step (on the cpu profile the two are equal to the microsecond).
    if plan.placement == "colocate" and saved > 0.01 * plan.rl_step_s.value and not gpu_broadcast:
        out.append(f"sync.method = {plan.sync_method!r} while colocated: ipc would be "
                   f"{saved:.1f} s faster per step")
    if plan.reward.used.value > plan.chosen.train_step.value:
        out.append(f"the reward phase ({plan.reward.used.text()}) is longer than training "
                   f"({plan.chosen.train_step.text()}): raise reward.concurrency")
    return out


def preflight(plan: Plan) -> list[str]:
    """Reasons `rlslurm submit` must refuse this job (empty = go): broken rules, OOM, a placement or sync
    method the job cannot run (rlslurm/plan/options.py names each), a timeout chain that cannot work
    (rlslurm/plan/timeouts.py)."""
    o, job = plan.option, plan.job
    where = f"{o.placement}, {o.split.train_gpus} training GPUs"
    trainer = [f"{key} {message}" for key, message in trainer_rules(job.train.backend, job.parallel,
                                                                      job.model.experts)]
    return ([r.message for r in plan.static_broken] + trainer + [f"{where}: {b}" for b in o.blockers]
            + timeouts(plan).problems())


def timeouts(plan: Plan) -> Chain:
    """The job's timeout chain (rlslurm/plan/timeouts.py); the drain's step is the plan's step time."""
    step = plan.rl_step_s if plan.job.job.kind == "rl" else plan.checkpoint_step_s
    return timeout_chain(plan.job, step_s=step.value)

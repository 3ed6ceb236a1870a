"""Step-time split of one RL step (rollout / reward / train / sync) and the amortisation of a change.

`timing:` in a job YAML: measured or estimated phase times that the planner scales. Weight sync is
bandwidth arithmetic per method; the reward phase is responses x latency / concurrency unless measured.
The lecture: 200 rollout + 60 reward + 150 train + sync = 480 s on disk (sync 14.6 %) vs. 413 s with
NCCL (0.7 %); 67 s x 2000 steps = 37 h of the whole cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check_range
from rlslurm.plan.hardware import HardwareConfig
from rlslurm.plan.quantity import Q
from rlslurm.reward.config import RewardConfig
from rlslurm.rl.config import RLConfig


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    train_step_s: float | None = None
    """Override: seconds of one training step measured with `train_step_ref_gpus` training GPUs; null = counted
    from the shape and the device's speed (rlslurm/plan/compute.py). Range [0.001, 1e7]."""
    train_step_ref_gpus: int | None = None
    """GPU count at which train_step_s was measured; null = all GPUs of the cluster. Range [1, 4096]."""
    rollout_s: float | None = None
    """Override: seconds of the rollout phase of one step (generation of all samples); null = counted
    (rlslurm/plan/compute.py). Range [0, 1e7]."""
    mfu: float = 0.4
    """Share of a GPU's peak matmul FLOP/s a training step and a prefill reach (the cpu profile uses this
    machine's measured rate as it is). Range (0, 1]."""
    reward_s: float | None = None
    """Override: seconds of the reward phase; null = computed from reward.latency_s and concurrency.
    Range [0, 1e7]."""
    total_steps: int = 100
    """Steps the job will run; the planner amortises per-step savings over them. Range [1, 1e9]."""

    def __post_init__(self):
        # A step of at least a millisecond: the checkpoint interval is counted in steps of this length.
        check_range(self.train_step_s, "train_step_s", 0.001, 10**7, note="seconds")
        check_range(self.train_step_ref_gpus, "train_step_ref_gpus", 1, 4096)
        for name in ("rollout_s", "reward_s"):
            check_range(getattr(self, name), name, 0, 10**7, note="seconds")
        check_range(self.total_steps, "total_steps", 1, 10**9)
        check_range(self.mfu, "mfu", 0, 1, low_open=True)


SyncMethod = Literal["disk", "broadcast", "ipc"]


def sync_times(weights: Q, hw: HardwareConfig, overhead_s: float = 0.0, run: str = "") -> dict[SyncMethod, Q]:
    """Seconds to move the weights once, per method (bandwidth-bound; the lecture's 70 s / ~3 s / sub-second),
    plus `overhead_s` a run measured beyond the bytes (the protocol's round trips)."""
    if overhead_s:
        plain = sync_times(weights, hw)
        return {k: Q(q.label, q.value + overhead_s, "s", f"{q.how} + protocol {overhead_s:.3g} s (measured: {run})")
                for k, q in plain.items()}
    hbm_gb_s = hw.hbm_tb_s * 1000
    return {
        "disk": Q("sync disk", weights.value / hw.fs_bandwidth_gb_s, "s",
                  f"{weights.text()} / filesystem {hw.fs_bandwidth_gb_s:g} GB/s (safetensors through NFS)"),
        "broadcast": Q("sync broadcast", weights.value / hw.interconnect_gb_s, "s",
                       f"{weights.text()} / interconnect {hw.interconnect_gb_s:g} GB/s (one torch/NCCL both sides)"),
        "ipc": Q("sync ipc", weights.value / hbm_gb_s, "s",
                 f"{weights.text()} / HBM {hbm_gb_s:g} GB/s (colocated only: shared GPU memory handles)"),
    }


@dataclass(frozen=True)
class RewardPhase:
    """Seconds of the reward phase: serial, concurrent, and the one the step uses."""

    responses: int
    serial: Q
    concurrent: Q
    used: Q


def reward_phase(rl: RLConfig, reward: RewardConfig, timing: TimingConfig,
                 per_response_s: float | None = None, run: str = "", task_rule_inline: bool = False) -> RewardPhase:
    """responses x latency (serial) vs. / concurrency; timing.reward_s, when measured, wins; else a run's
    measured seconds per response (`per_response_s`, rlslurm/plan/calibration.py) over the step's responses; else,
    for the generated task scored by its rule in the controller (`task_rule_inline`: reward.service inline, no
    data.train), nothing: microseconds a response as each arrives (the demo measured 1e-5 s a step)."""
    n = rl.prompts_per_step * rl.samples_per_prompt
    count = f"{rl.prompts_per_step} prompts x {rl.samples_per_prompt} samples = {n} responses x {reward.latency_s:g} s"
    serial = Q("reward serial", n * reward.latency_s, "s", count)
    concurrent = Q("reward concurrent", n * reward.latency_s / reward.concurrency, "s",
                   f"{count} / reward.concurrency {reward.concurrency}")
    if timing.reward_s is not None:
        used = Q("reward phase", timing.reward_s, "s", "timing.reward_s, measured")
    elif per_response_s is not None:
        used = Q("reward phase", n * per_response_s, "s", f"{n} responses x {per_response_s:.3g} s (measured: {run})")
    elif task_rule_inline:
        used = Q("reward phase", 0.0, "s", "the task's rule, scored in the controller as each response arrives")
    else:
        used = Q("reward phase", concurrent.value, "s", "concurrent, from reward.latency_s")
    return RewardPhase(n, serial, concurrent, used)


def train_step_s(timing: TimingConfig, train_gpus: int, total_gpus: int, recompute: Q | None = None) -> Q:
    """Training step time scaled linearly with the GPU count from the one measured (strong scaling), and by
    `recompute` (rlslurm/plan/recompute.py's recompute_scale) when memory.recompute is not the mode it was
    measured under."""
    ref = timing.train_step_ref_gpus or total_gpus
    scale = recompute.value if recompute is not None else 1.0
    how = f"timing.train_step_s {timing.train_step_s:g} s x {ref} GPUs / {train_gpus} GPUs"
    if scale != 1.0:
        how += f" x {recompute.how}"
    return Q("train step", timing.train_step_s * ref / train_gpus * scale, "s", how)


@dataclass(frozen=True)
class StepSplit:
    """One RL step under one sync method: phase seconds, total, and each phase's share."""

    method: SyncMethod
    placement: str
    rollout_s: float
    reward_s: float
    train_s: float
    sync_s: float
    offload_s: float
    idle_s: float = 0.0
    """Seconds outside the phases (experience broadcast, bookkeeping): 0 unless a run measured it."""
    overlapped: bool = False
    """The experience (rollout + reward) of the next steps is made while this one trains (rl.max_staleness >= 1,
    no offload between them): the step is the longer of the two, not their sum."""

    @property
    def total_s(self) -> float:
        return self.busy_s + self.sync_s + self.offload_s + self.idle_s

    @property
    def busy_s(self) -> float:
        """Rollout + reward and train: one after the other, or side by side when overlapped. Side by side the
        sync still waits for the rollouts it must not straddle (rlslurm/rl/pipeline.py), and on shared devices
        (CPU cores, one box) each phase is slower than alone: a run at the same rl.max_staleness measures that
        contention into its phase times, and `--from-run` carries it."""
        experience = self.rollout_s + self.reward_s
        return max(experience, self.train_s) if self.overlapped else experience + self.train_s

    @property
    def hidden_s(self) -> float:
        """Seconds of experience or training the overlap hides (0 in turn)."""
        return self.rollout_s + self.reward_s + self.train_s - self.busy_s

    def formula(self) -> str:
        """How total_s adds up, in words."""
        if self.overlapped:
            return "max(rollout + reward, train) + sync + offload + idle (rl.max_staleness >= 1: side by side)"
        return "rollout + reward + train + sync + offload + idle"

    def share_pct(self, seconds: float) -> float:
        return 100.0 * seconds / self.total_s if self.total_s else 0.0


def overlaps(ahead: int, placement: str, profile: str, offload_s: float) -> bool:
    """Whether a step's experience runs beside its training: rl.max_staleness (`ahead`) >= 1, on devices of its
    own (placement separate) or on CPU cores, and no offload between them (an engine that sleeps for the trainer
    to fit cannot generate while it trains). Colocated on a GPU, the engine and the trainer take turns on the
    same SMs: the plan adds them up. On CPU cores neither phase fills the cores (the demo, 2 cores: rollout 0.107 s
    and train 0.114 s side by side, step 0.144 s), and the contention is in what a run at the same k measures."""
    return ahead >= 1 and offload_s == 0.0 and (placement == "separate" or profile == "cpu")


@dataclass(frozen=True)
class Amortisation:
    """What switching from disk sync to a faster method saves over the whole job."""

    method: SyncMethod
    saved_per_step: Q
    saved_total_h: Q
    saved_gpu_h: Q


def amortise(syncs: dict[SyncMethod, Q], offload_per_step_s: float, total_steps: int,
             total_gpus: int) -> list[Amortisation]:
    """Seconds saved per step x timing.total_steps, in hours of the whole cluster (and GPU-hours)."""
    disk = syncs["disk"]
    out = []
    for method in ("broadcast", "ipc"):
        extra = offload_per_step_s if method == "ipc" else 0.0
        cost = f" - offload {extra:.2f} s" if extra else ""
        saved = Q(f"saved by {method}", disk.value - syncs[method].value - extra, "s/step",
                  f"disk {disk.text()} - {method} {syncs[method].text()}{cost}")
        hours = Q(f"saved by {method} over the job", saved.value * total_steps / 3600, "h",
                  f"{saved.text()} x timing.total_steps {total_steps} / 3600")
        gpu_h = Q(f"GPU-hours saved by {method}", hours.value * total_gpus, "GPU-h",
                  f"{hours.text()} x {total_gpus} GPUs")
        out.append(Amortisation(method, saved, hours, gpu_h))
    return out

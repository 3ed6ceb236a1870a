"""Every layout the job could run, its step time, and whether rlslurm's runtime can run it.

An option is a placement (colocate: rollout time-shares all GPUs; separate: r nodes of their own) and a
weight-sync method. Its step is rollout + reward + train at its split + sync by its method + offload.
rlslurm/plan/report.py chooses the fastest option the job can run; the others are printed with what
stops them, each a sentence `rlslurm submit`'s pre-flight repeats when the config asks for it:

  - the trainer does not fit (OOM) or the layout breaks a divisibility rule;
  - ipc needs colocation (an engine on another node cannot map the trainer's memory);
  - broadcast beside trainer rank 0 on a GPU: NCCL refuses two ranks of one group on one GPU;
  - colocation whose engine does not fit beside the training peak needs the training state moved to host
    RAM during rollout (the lecture's offload): the runtime does not do that yet (nothing moves trainer
    state to host RAM), so such an option is shown with its figures, marked `not runnable yet`, never chosen;
  - a separate split whose engines' KV cache holds no sequence;
  - a node asked for more GPUs than hardware.gpus_per_node: engines per rollout node, or colocated engines,
    x rollout.tp (rlslurm/plan/gpus.py: every engine has GPUs of its own).
A split with `not advised` headroom runs, but only when asked for by placement.rollout_nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlslurm.plan.decode import KVCache, RolloutCapacity, capacity
from rlslurm.plan.gpus import gpu_plan
from rlslurm.plan.placement import Colocate
from rlslurm.plan.quantity import Q
from rlslurm.plan.splits import Split
from rlslurm.plan.steptime import StepSplit, SyncMethod, overlaps

if TYPE_CHECKING:  # config.py imports this package's config classes: no cycle at run time
    from rlslurm.config import JobConfig

Placement = Literal["colocate", "separate"]
PLACEMENTS: tuple[Placement, ...] = ("colocate", "separate")
METHODS: tuple[SyncMethod, ...] = ("disk", "broadcast", "ipc")
NOT_YET = "not runnable yet"


@dataclass(frozen=True)
class Option:
    """One placement x split x sync method: its step and what stops the job from running it."""

    placement: Placement
    split: Split
    step: StepSplit
    blockers: tuple[str, ...]
    """Why the job cannot run this option, each naming the keys and numbers (empty: it can)."""
    reasons: tuple[str, ...]
    """The same, a few words each (the step table's neighbours)."""
    not_yet: bool
    """Blocked only by what the runtime does not implement yet (training-state offload)."""
    rollout: RolloutCapacity | None
    """The engines' KV capacity on the rollout GPUs of a separate split."""

    @property
    def method(self) -> SyncMethod:
        return self.step.method

    @property
    def runnable(self) -> bool:
        return not self.blockers

    @property
    def advised(self) -> bool:
        """Runnable and with headroom ok or tight: the plan chooses among these first."""
        return self.runnable and self.split.runnable

    @property
    def where(self) -> str:
        nodes = f", {self.split.rollout_nodes} rollout node(s)" if self.placement == "separate" else ""
        return f"{self.placement}{nodes}, {self.method} sync"

    @property
    def status(self) -> str:
        """One word or two for the step table: ok, not advised, not runnable yet, OOM, refused."""
        if self.runnable:
            return "ok" if self.advised else "not advised"
        if self.not_yet:
            return NOT_YET
        return "OOM" if self.split.verdict == "OOM" else "refused"


Blocker = tuple[str, str]
"""(a few words, the sentence that names the keys, the numbers and the fix)."""
SHRINK = "or shrink the training peak (memory.fused_ce, memory.recompute, more training GPUs)"


def _offload_blockers(colo: Colocate, resident: Q, job: "JobConfig") -> tuple[list[Blocker], bool]:
    """Colocation whose engine does not fit beside the training peak: (blockers, only not-yet ones)."""
    need = (f"the engine needs {colo.engine_need_gb.text()} per GPU but the training peak leaves "
            f"{colo.free_gb.text()}")
    if not job.placement.offload:
        return [("the engine does not fit beside the training peak",
                 f"colocate without offload: {need} (placement.offload: false); set placement.mode: separate, "
                 + SHRINK)], False
    out = [("needs training-state offload, not implemented",
            f"colocate: {need}: it runs only if the training state (resident {resident.text()}) moves to host RAM "
            f"during rollout ({colo.offload_per_step_s.text()} per step), which rlslurm's runtime does not do yet; "
            "set placement.mode: separate (or auto), " + SHRINK)]
    if not colo.host_ram_fits:
        out.append(("offload does not fit in host RAM",
                    f"colocate with offload needs {colo.host_ram_per_node_gb.text()} host RAM per node "
                    f"> hardware.host_ram_gb = {job.hardware.host_ram_gb:g}"))
        return out, False
    return out, True


def _split_blockers(s: Split, job: "JobConfig") -> list[Blocker]:
    out = [("breaks a divisibility rule", r.message) for r in s.broken]
    if s.memory is not None and s.verdict == "OOM":
        out.append((f"trainer OOM (peak {s.memory.peak.text()})",
                    f"trainer OOM, peak {s.memory.peak.text()} > {job.hardware.gpu_mem_gb:g} GB per GPU "
                    f"({s.memory.peak.how})"))
    return out


def option(job: "JobConfig", placement: Placement, s: Split, method: SyncMethod, colo: Colocate,
           syncs: dict[SyncMethod, Q], reward_s: float, kv: KVCache, weights: Q, advice: str,
           rollout_s: float = 0.0, idle_s: float = 0.0) -> Option:
    """The option `placement` at split `s` with `method`, its step and its blockers."""
    blockers, not_yet, cap = _split_blockers(s, job), False, None
    offload_s = 0.0
    if placement == "colocate":
        # An SFT (or toy) job runs no engine: nothing has to fit beside its training peak.
        if job.job.kind == "rl" and s.memory is not None and colo.train_verdict not in ("OOM", "invalid") \
                and not colo.fits_without_offload:
            offload_s = colo.offload_per_step_s.value
            more, not_yet = _offload_blockers(colo, s.memory.resident, job)
            not_yet = not_yet and not blockers
            blockers += more
        if method == "broadcast" and job.hardware.profile != "cpu":
            blockers.append(("NCCL refuses two ranks on one GPU",
                             "sync.method = 'broadcast' with placement colocate on GPUs: the engines start beside "
                             "trainer rank 0 and share its GPU, and NCCL refuses two ranks of one group on one GPU "
                             "('Duplicate GPU detected'); set sync.method: ipc (the same GPU's memory, no copy) or "
                             "disk, or placement.mode: separate"))
            not_yet = False
    else:
        if not s.rollout_gpus:
            blockers.append(("no node can leave training",
                             "placement.mode = 'separate' but no node can leave training: " + advice))
        elif not s.broken:
            cap = capacity(weights, kv, job.hardware, job.rollout, s.rollout_gpus, job.placement.engine_overhead_gb)
            if cap.seqs_per_engine.value < 1:
                blockers.append(("the engines' KV cache holds no sequence",
                                 f"rollout: one engine's KV space {cap.kv_space_per_gpu.text()} per GPU holds no "
                                 f"sequence of rollout.max_seq_len = {job.rollout.max_seq_len}"))
        if method == "ipc":
            blockers.append(("ipc needs colocation",
                             "sync.method = 'ipc' needs colocation (engines on other nodes cannot map the trainer's "
                             "memory), and the plan places rollout separate: set placement.mode: colocate, or "
                             "sync.method: broadcast or disk"))
            not_yet = False
    gpus = gpu_plan(job, placement, s.rollout_nodes).problems
    if gpus:
        blockers += [("more GPUs than a node has", p) for p in gpus]
        not_yet = False
    ahead = job.rl.max_staleness if job.job.kind == "rl" else 0
    step = StepSplit(method, placement, rollout_s, reward_s, s.train_step.value, syncs[method].value, offload_s,
                     idle_s, overlapped=overlaps(ahead, placement, job.hardware.profile, offload_s))
    return Option(placement, s, step, tuple(b for _, b in blockers), tuple(r for r, _ in blockers), not_yet, cap)


def all_options(job: "JobConfig", splits: list[Split], colo: Colocate, syncs: dict[SyncMethod, Q], reward_s: float,
                kv: KVCache, weights: Q, advice: str, rollout_s: float = 0.0, idle_s: float = 0.0) -> list[Option]:
    """Colocation on every GPU, then each separate split (1 .. nodes - 1 rollout nodes), each sync method."""
    return [option(job, placement, s, method, colo, syncs, reward_s, kv, weights, advice, rollout_s, idle_s)
            for placement, group in (("colocate", splits[:1]), ("separate", splits[1:]))
            for s in group for method in METHODS]

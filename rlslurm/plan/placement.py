"""Where rollout runs: colocated with training (time-shared, offload) or on nodes of its own.

`placement:` in a job YAML. Colocating without offload needs the engine (weights per TP group + KV
cache + its own overhead) to fit in what the training peak leaves; otherwise the training state
(resident GB) would have to move to host RAM during rollout and back: resident / PCIe GB/s each way,
twice a step, and gpus_per_node x resident of host RAM per node (the lecture: 38.1 GB / 64 GB/s = 0.6 s,
304 GB). rlslurm's runtime does not offload training state yet: the plan shows those figures and never
chooses such a colocation (rlslurm/plan/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check_range
from rlslurm.plan.decode import KVCache
from rlslurm.plan.hardware import HardwareConfig
from rlslurm.plan.memory import TrainerMemory
from rlslurm.plan.quantity import Q
from rlslurm.rollout.config import RolloutConfig


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    mode: Literal["auto", "colocate", "separate"] = "auto"
    """auto takes the plan's recommendation; colocate time-shares GPUs; separate gives rollout its own nodes."""
    rollout_nodes: int | None = None
    """Nodes given to rollout when separate (fewer than hardware.nodes); null = the plan's recommendation.
    Range [0, 64]."""
    offload: bool = True
    """Consider colocation with the training state moved to host RAM during rollout where the engine does not
    fit beside the training peak: the plan shows its cost, marked not runnable yet (the runtime does not
    offload); false: such a colocation is shown as not fitting."""
    engine_overhead_gb: float = 0.5
    """GPU memory an engine needs beyond weights and KV cache (forward activations, CUDA graphs), in GB.
    Range [0, 100000]."""
    colocate_min_seqs: int = 1
    """Sequences of rollout.max_seq_len the KV cache must hold for colocation without offload to count.
    Range [1, 1000000]."""

    def __post_init__(self):
        check_range(self.rollout_nodes, "rollout_nodes", 0, 64)
        check_range(self.engine_overhead_gb, "engine_overhead_gb", 0, 100_000, note="GB")
        check_range(self.colocate_min_seqs, "colocate_min_seqs", 1, 1_000_000)


def stated_placement(pl: PlacementConfig) -> Literal["colocate", "separate"] | None:
    """The placement the config states outright (mode colocate; mode separate, or rollout_nodes > 0);
    None under mode auto without rollout_nodes, where the plan chooses by its numbers (plan/report.py)."""
    if pl.mode == "colocate":
        return "colocate"
    if pl.mode == "separate" or (pl.rollout_nodes or 0) > 0:
        return "separate"
    return None


@dataclass(frozen=True)
class Colocate:
    """Colocation on all GPUs: does the engine fit beside the training peak, and what offload costs."""

    train_verdict: str
    free_gb: Q
    engine_need_gb: Q
    fits_without_offload: bool
    offload_each_way_s: Q
    offload_per_step_s: Q
    host_ram_per_node_gb: Q
    host_ram_fits: bool

    @property
    def feasible(self) -> bool:
        """Colocation could run on paper: training itself fits, and either the engine fits or offload would
        (the runtime runs only the first: rlslurm/plan/options.py)."""
        return self.train_verdict not in ("OOM", "invalid") and (self.fits_without_offload or self.host_ram_fits)


def colocate(all_gpus: TrainerMemory | None, hw: HardwareConfig, rollout: RolloutConfig, kv: KVCache, weights: Q,
             placement: PlacementConfig) -> Colocate:
    """Check colocation against `all_gpus`, the trainer's memory when every GPU trains (None: invalid layout)."""
    if all_gpus is None:
        nan = float("nan")
        return Colocate("invalid", *(Q(name, nan, unit, "the all-GPU layout breaks a divisibility rule")
                                     for name, unit in (("free beside training peak", "GB"), ("engine needs", "GB"))),
                        False, *(Q(name, nan, unit) for name, unit in (("offload each way", "s"),
                                 ("offload per step", "s"), ("host RAM per node", "GB"))), False)
    hbm, peak = hw.gpu_mem_gb, all_gpus.peak.value
    free = Q("free beside training peak", max(0.0, hbm - peak), "GB", f"{hbm:g} GB - peak {all_gpus.peak.text()}")
    per_gpu = weights.value / rollout.tp
    kv_gb = placement.colocate_min_seqs * rollout.max_seq_len * kv.per_token_per_gpu.value * 1024 / 1e9
    need = Q("engine needs", per_gpu + kv_gb + placement.engine_overhead_gb, "GB",
             f"weights {weights.text()} / rollout.tp {rollout.tp} + KV {placement.colocate_min_seqs} x "
             f"{rollout.max_seq_len} tokens x {kv.per_token_per_gpu.text()} "
             f"+ overhead {placement.engine_overhead_gb:g} GB")
    fits = all_gpus.verdict != "OOM" and need.value <= free.value
    resident = all_gpus.resident
    link = hw.host_link_gb_s
    each = Q("offload each way", resident.value / link, "s", f"resident {resident.text()} / PCIe {link:g} GB/s")
    step = Q("offload per step", 2 * each.value, "s", f"2 x {each.text()} (out before rollout, back after)")
    ram = Q("host RAM per node", hw.gpus_per_node * resident.value, "GB",
            f"{hw.gpus_per_node} GPUs x resident {resident.text()}")
    return Colocate(all_gpus.verdict, free, need, fits, each, step, ram, ram.value <= hw.host_ram_gb)

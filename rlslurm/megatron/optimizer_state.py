"""Megatron's optimizer in a checkpoint: the step count, and each rank's share of Adam, written without a gather.

    state = OptimizerState(owner)       # owner: the RL policy or the SFT state (megatron_optimizer, steps, ...)
    ckpt.save_state("optimizer", state.state_dict()); state.save_shards(tmp_dir)     # every rank its shard
    state.load_state_dict(ckpt.load_state("optimizer")); state.load_shards(ckpt)   # after the model's weights

rlslurm/rl/checkpointing.py (`write_shards`) runs the protocol for both entrances: rank 0 opens the
checkpoint's temp dir, every rank writes its `optimizer-rank<NNNNN>.pt` there, all land in the manifest.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlslurm.errors import RlslurmError

log = logging.getLogger(__name__)


class OptimizerState:
    """What a checkpoint holds of Megatron's optimizer: the step count in `optimizer.pt` (rank 0), and each
    rank's share of Adam in its own `optimizer-rank<NNNNN>.pt` (`save_shards`, `load_shards`).

    `owner` (rlslurm/megatron/policy.py's MegatronPolicy, rlslurm/megatron/sft.py's MegatronSFTState) has
    `megatron_optimizer`, `steps` (optimizer steps taken; set back on load), `topo`, `layout` and `job`.

    Each of Megatron's optimizers wraps a torch optimizer (`.optimizer`) whose parameters are the fp32
    master weights this rank updates (with the distributed optimizer, its DP slice of them) and whose
    state holds Adam's moments of exactly those. A rank saves that torch optimizer's state dict and the
    master weights, untouched and without any gather, and loads them back into the same places. Without
    them a resumed run would restart Adam at zero moments and, with bf16 weights, lose the master
    weights' low bits. The shards are cut by the layout: a resume must keep world size and parallel.tp."""

    def __init__(self, owner):
        self.owner = owner
        self._saved: dict = {}

    def _layout(self) -> dict:
        return {"world_size": self.owner.topo.world_size, "tp": self.owner.layout.tp,
                "distributed_optimizer": self.owner.distributed_optimizer}

    def _inner(self) -> list:
        """The torch optimizers inside Megatron's (one per chained part)."""
        opt = self.owner.megatron_optimizer
        return [part.optimizer for part in getattr(opt, "chained_optimizers", [opt])]

    def _shard_name(self, rank: int) -> str:
        return f"optimizer-rank{rank:05d}"

    def state_dict(self) -> dict:
        return {"backend": "megatron", "steps": self.owner.steps, "layout": self._layout(),
                "shards": self.owner.topo.world_size if self.owner.steps else 0}

    def load_state_dict(self, state: dict) -> None:
        self.owner.steps = int(state.get("steps", 0))
        self._saved = state

    def save_shards(self, directory: Path) -> list[str]:
        """This rank's Adam state and master weights into `directory` (every rank; nothing collective)."""
        from rlslurm.checkpoint import write_rank_state

        if self.owner.steps == 0:  # no step taken: nothing but zeros to save
            return []
        parts = [{"state_dict": inner.state_dict(),
                  "master": [p.detach().cpu().clone() for group in inner.param_groups for p in group["params"]]}
                 for inner in self._inner()]
        shard = {"layout": self._layout(), "steps": self.owner.steps, "parts": parts}
        return [write_rank_state(directory, self._shard_name(self.owner.topo.rank), shard)]

    def load_shards(self, ckpt) -> None:
        """After `load_state_dict` and the model's weights: this rank's Adam state and master weights back."""
        if not self._saved.get("shards"):
            if self.owner.steps:
                log.warning("train.backend = megatron: checkpoint %s holds no optimizer shards; Adam's moments "
                            "restart at step %d", ckpt.name, self.owner.steps)
            return
        if self._saved.get("layout") != self._layout():
            raise RlslurmError(
                f"checkpoint {ckpt.path} was written with {self._saved.get('layout')}, this run is "
                f"{self._layout()}: Megatron's optimizer shards are cut by that layout. Resume with the same "
                "world size and parallel.tp, or start a new run from its weights (train.init_from = its export)")
        shard = ckpt.load_state(self._shard_name(self.owner.topo.rank))
        inners = self._inner()
        if len(shard["parts"]) != len(inners):
            raise RlslurmError(f"checkpoint {ckpt.path}: {len(shard['parts'])} optimizer parts saved, this run "
                               f"builds {len(inners)}: the model or its parallel layout changed")
        for inner, part in zip(inners, shard["parts"]):
            inner.load_state_dict(part["state_dict"])
            params = [p for group in inner.param_groups for p in group["params"]]
            if [p.shape for p in params] != [m.shape for m in part["master"]]:
                raise RlslurmError(f"checkpoint {ckpt.path}: the saved master weights' shapes differ from this "
                                   "run's: the model or its parallel layout changed")
            with torch.no_grad():
                for p, master in zip(params, part["master"]):
                    p.copy_(master)
        # The model's own weights came from the checkpoint's HF tensors (HFView.load_state_dict): the cast
        # of these master weights taken after the last step, so the two agree without a copy.
        log.info("megatron trainer: Adam's moments and master weights restored from %s (step %d)",
                 ckpt.name, self.owner.steps)

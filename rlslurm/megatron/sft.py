"""`train.backend = megatron` in the SFT job: the training state jobs/sft.py trains, checkpoints and exports.

    state = MegatronSFTState(job, topo, lr_at)     # jobs/sft.py's build_state picks it by train.backend
    loss, grad_norm = state.train_step(batch, beat)  # one optimizer step through Megatron's schedule
    state.save(run, topo, keep); state.load(ckpt, topo)
    path, hf_model = state.export(directory, max_new_tokens)   # collective; rank 0 writes and gets the model

The same job as the torch backend's SFTState (jobs/sft.py), on Megatron-core: the start is the very
weights the torch backend starts from (the embedded model built from `model:` at train.seed, or
train.init_from), loaded into Megatron's GPTModel through rlslurm/megatron/convert.py; each step is
rlslurm/megatron/trainer.py's `train_step` (Megatron's DDP, distributed optimizer and schedule) on the
rank's share cut into forwards of parallel.micro_batch_size sequences, the loss the mean negative
log-likelihood of the answer tokens of the whole share, as the HF loss of the torch backend; the learning
rate follows jobs/sft.py's schedule as a function of the step. A checkpoint holds the HF-named weights,
each rank's Adam shard (rlslurm/megatron/optimizer_state.py through rlslurm/rl/checkpointing.py's
`write_shards`), the step and every rank's RNG. The export is the HF directory an engine loads (gathered
over TP, written by rank 0 through rlslurm/tinymodel.py's save_hf), and the held-out accuracy is measured
on that export as transformers loads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from rlslurm.checkpoint import Checkpoint, CheckpointWriter
from rlslurm.dist import Topology, compute_device
from rlslurm.errors import CheckpointError
from rlslurm.megatron.device import on_device
from rlslurm.megatron.optimizer_state import OptimizerState
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)

IGNORE = -100
"""Label value of a position that is not learned (prompt, padding): the HF convention jobs/sft.py uses."""


class MegatronSFTState:
    """Megatron's GPTModel, DDP and distributed optimizer, and the step: the whole SFT training state."""

    def __init__(self, job, topo: Topology, lr_at: Callable[[int], float]):
        from rlslurm.megatron.policy import build_metered_trainer, hf_model_spec, spec_from_config
        from rlslurm.tinymodel import build_model, load_hf

        self.job, self.topo, self.lr_at = job, topo, lr_at
        self.device = compute_device()
        if job.train.init_from:
            hf, _ = load_hf(job.train.init_from)
            self.spec, norm_eps = hf_model_spec(job.train.init_from)
        else:
            # The torch backend's start: the embedded model at train.seed (shape and RMSNorm epsilon from its config).
            hf = build_model(job.model, seed=job.train.seed)
            self.spec, norm_eps = spec_from_config(hf.config.to_dict(), name=job.model.name, where="model:")
        start = {name: t.detach().float() for name, t in hf.state_dict().items()}
        self.hf = hf if topo.is_main else None  # rank 0's template of the export (its config and tensor names)
        build_metered_trainer(self, job, norm_eps, start)
        self.steps = 0
        self.optimizer = OptimizerState(self)

    def _owned(self) -> list[torch.Tensor]:
        """What this rank holds between steps (the CPU meter seeds it): rlslurm/megatron/policy.py's list."""
        from rlslurm.megatron.policy import megatron_owned

        return megatron_owned(self.gpt, self.megatron_optimizer)

    # -- what jobs/sft.py's loop reads ----------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps done; also the data position (jobs/sft.py's batch_indices)."""
        return self.steps

    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.lr_at(self.steps)

    def params(self) -> int:
        """Parameters of this rank's shard of the model."""
        return sum(p.numel() for p in self.gpt.parameters())

    def train_step(self, batch: dict[str, torch.Tensor], beat=lambda: None) -> tuple[float, float]:
        """One optimizer step on this rank's share; (loss averaged over ranks, gradient norm before clipping)."""
        from rlslurm.megatron.trainer import train_step

        stats = train_step(self.ddp, self.megatron_optimizer, self.micro_batches(batch), lr=self.lr(),
                           fused=self.job.memory.fused_ce, meter=self.meter)
        beat()
        self.steps += 1
        reported = torch.tensor([stats["loss"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(reported)
        return float(reported.item()) / dist.get_world_size(), stats["grad_norm"]

    def micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """jobs/sft.py's batch (input_ids, labels with IGNORE, attention mask) as the micro-batches of
        trainer.train_step: tokens and the next token to predict; each answer token weighs 1 / (answer
        tokens of the whole share), so the step's loss is their mean, as the HF loss of the torch backend."""
        tokens, labels = batch["input_ids"][:, :-1], batch["labels"][:, 1:]
        weights = (labels != IGNORE).float()
        weights = weights / weights.sum().clamp(min=1)
        labels = labels.masked_fill(labels == IGNORE, 0)  # any valid id: its weight is 0
        size = self.job.parallel.micro_batch_size
        return [{"tokens": tokens[i:i + size], "labels": labels[i:i + size], "weights": weights[i:i + size]}
                for i in range(0, tokens.shape[0], size)]

    # -- checkpoint ---------------------------------------------------------------------------------------

    def _hf_tensors(self) -> dict[str, torch.Tensor]:
        """Collective: the HF-named weights, gathered over TP, on every rank (CPU, fp32)."""
        from rlslurm.megatron.convert import export_hf

        return {name: t.detach().to("cpu", torch.float32, copy=True)
                for name, t in export_hf(self.gpt, self.spec, self.layout)}

    def save(self, run: RunDir, topo: Topology, keep: int, trainer: dict | None = None) -> float:
        """Collective: rank 0 writes the weights, step and every rank's RNG; every rank its Adam shard.
        `trainer`: more of the loop's state for trainer.json (the data position)."""
        from rlslurm.rl.checkpointing import write_shards

        rngs: list = [None] * topo.world_size
        dist.all_gather_object(rngs, torch.get_rng_state())
        tensors = self._hf_tensors()
        seconds = [0.0]
        with contextlib.ExitStack() as stack:
            ckpt = None
            if topo.is_main:
                ckpt = stack.enter_context(CheckpointWriter(run, self.steps, keep=keep, metadata={
                    "job": "sft", "backend": "megatron", "world_size": topo.world_size}))
            for filename in write_shards(self.optimizer, ckpt, topo):
                ckpt.add_written(filename)
            if ckpt is not None:
                ckpt.save_tensors("model", tensors)
                ckpt.save_state("optimizer", self.optimizer.state_dict())
                ckpt.save_state("rng", rngs)
                ckpt.save_json("trainer", {"step": self.steps, **(trainer or {})})
        if ckpt is not None:
            seconds = [ckpt.saved.seconds]
        dist.broadcast_object_list(seconds, src=0)
        return seconds[0]

    def load(self, ckpt: Checkpoint, topo: Topology) -> None:
        """Every rank: the weights into Megatron (and its fp32 master weights), the step, its Adam shard and
        its RNG."""
        from rlslurm.megatron.convert import load_hf_into

        load_hf_into(self.gpt, ckpt.load_tensors("model"), self.spec, self.layout)
        with on_device():
            self.megatron_optimizer.reload_model_params()
        self.optimizer.load_state_dict(ckpt.load_state("optimizer"))
        self.optimizer.load_shards(ckpt)
        rngs = ckpt.load_state("rng")
        if len(rngs) != topo.world_size:
            raise CheckpointError(f"{ckpt.path} holds the RNG of {len(rngs)} ranks, this job has {topo.world_size}")
        torch.set_rng_state(rngs[topo.rank])
        self.steps = int(ckpt.load_json("trainer")["step"])

    # -- the result -------------------------------------------------------------------------------------

    def weights_sha256(self) -> str:
        """Collective: one checksum over the HF-named weights (every rank computes it from its gather)."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self._hf_tensors().items()):
            digest.update(name.encode())
            digest.update(tensor.contiguous().numpy().tobytes())
        return digest.hexdigest()

    def eval_model(self):
        """Collective: the transformers model holding the current weights on rank 0 (gathered over TP), None on
        the other ranks: what the dev split's greedy decode reads (jobs/sft_eval.py StopAtTarget)."""
        tensors = self._hf_tensors()
        if not self.topo.is_main:
            return None
        self.hf.load_state_dict(tensors, strict=False)
        return self.hf

    def export(self, directory: Path, max_new_tokens: int):
        """Collective: the HF directory an engine loads; rank 0 writes it and gets (path, the transformers
        model loaded back from it), the other ranks (None, None)."""
        from rlslurm.tinymodel import load_hf, save_hf

        tensors = self._hf_tensors()
        if not self.topo.is_main:
            return None, None
        missing, unexpected = self.hf.load_state_dict(tensors, strict=False)
        tied = {"lm_head.weight"} if self.spec.tie_embeddings else set()
        if unexpected or set(missing) - tied:
            raise CheckpointError("the Megatron export does not fit the HF model: missing "
                                  f"{sorted(set(missing) - tied)}"
                                  f", unexpected {sorted(unexpected)}")
        path = save_hf(self.hf, directory, max_new_tokens=max_new_tokens)
        model, _ = load_hf(path)  # what an engine serves: the export as transformers reads it
        return path, model


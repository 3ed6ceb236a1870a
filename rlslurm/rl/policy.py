"""The trained policy on every trainer rank: one interface, two backends.

    policy = make_policy(job, topo, model_dir)     # train.backend: torch (Policy here) or megatron
    stats = policy.update(samples, guard, step_total=len(all_samples))   # rl.mini_batches optimizer steps
    weights = policy.weights()                      # {HF name: tensor}: what the engines serve

`RLPolicy` is the contract the RL loop and its checkpoints use, and nothing else: `Policy` (DDP on
torch, the default) and `rlslurm.megatron.policy.MegatronPolicy` both implement it, and
tests/unit/test_policy_contract.py holds both to its methods and arguments (a call the Megatron policy
does not accept fails in CI, not first on a GPU).
"""

from __future__ import annotations

import abc
import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlslurm.config import JobConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, compute_device
from rlslurm.rl.batches import micro_batches, mini_batches, share_sizes
from rlslurm.rl.experience import Sample
from rlslurm.rl.objective import Packed, UpdateStats, behaviour_logprobs, grpo_objective, kl_to_reference, pack
from rlslurm.tinymodel import load_hf
from rlslurm.tokenizer import PAD_ID
from rlslurm.train_config import adamw


class RLPolicy(abc.ABC):
    """What the RL loop (rlslurm/rl/loop.py) and its checkpoints (rlslurm/rl/checkpointing.py) use of a
    policy. Attributes: `model` (an nn.Module, or a view with load_state_dict / save_pretrained: what a
    checkpoint's HF tensors load into and the export saves), `optimizer` (state_dict / load_state_dict;
    a sharded one adds save_shards / load_shards), `tokenizer`, `device`."""

    model: object
    optimizer: object
    tokenizer: object
    device: torch.device

    @abc.abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors the engines serve, in Hugging Face names (a tied tensor once)."""

    @abc.abstractmethod
    def update(self, samples: list[Sample], guard: PhaseGuard, *, step_total: int | None = None) -> dict:
        """One RL step's clipped GRPO update on this rank's share `samples` (`samples[rank::world]` of the
        step's): rl.mini_batches optimizer steps of parallel.micro_batch_size forwards (rlslurm/rl/batches.py);
        `step_total` is the step's sample count over all ranks (0: no rank trains, every rank skips).
        Returns the step's stats (loss, tokens, mini_batches, ...)."""


class Policy(RLPolicy):
    """The trained model (DDP), its optimizer and the optional frozen reference for the KL term."""

    def __init__(self, job: JobConfig, topo: Topology, model_dir: Path):
        self.job, self.topo = job, topo
        model, self.tokenizer = load_hf(model_dir)  # the tokenizer: the controller's, and the export's
        self.device = compute_device()
        self.model = model.float().to(self.device)
        self.ddp = DistributedDataParallel(self.model) if topo.world_size > 1 else self.model
        self.optimizer = adamw(self.model, job.train)
        self.reference = None
        if job.rl.kl_coef > 0:
            self.reference, _ = load_hf(model_dir)
            self.reference.float().to(self.device).eval().requires_grad_(False)

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors the engines serve, in Hugging Face names; a tied tensor once, under its first name
        (the engine dedups the same way: `lm_head.weight` is `model.embed_tokens.weight`)."""
        out, seen = {}, set()
        for name, tensor in self.model.state_dict().items():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            out[name] = tensor.detach()
        return out

    @staticmethod
    def _logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Log-probability of every token given the ones before it: column t scores ids[:, t + 1]."""
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    def _packed_logprobs(self, model, batch: Packed) -> torch.Tensor:
        return self._logprobs(model, batch.ids(), batch.attention())

    def update(self, samples: list[Sample], guard: PhaseGuard, *, step_total: int | None = None) -> dict:
        """Clipped GRPO updates on this rank's share: rl.mini_batches optimizer steps, each accumulating
        the gradients of forward passes of parallel.micro_batch_size sequences (DDP's all-reduce only
        on the last: `no_sync` before), each the exact mean over its mini-batch's sequences on all ranks
        (rlslurm/rl/batches.py). `step_total` = the step's samples over all ranks (None: this share is all).

        The ratio is pi_theta / pi_behaviour, the behaviour log-probs taken once before the first step. A
        fresh sample (staleness 0) was sampled by these very weights, so its behaviour log-probs are the
        trainer's own (`old`): the first mini-batch's ratio is exactly 1 and its clip idle, the later ones'
        ratio is how far the earlier steps moved (PPO's trust region). A stale one (rl.max_staleness > 0)
        was sampled by an older policy: its behaviour log-probs are the engine's, and where the policy has
        since moved a token past 1 +- clip_eps in the direction of its advantage, the clip stops the
        gradient, so running ahead cannot compound an update the fresh samples would not make.
        """
        job, world = self.job, self.topo.world_size
        total = len(samples) if step_total is None else step_total
        self.optimizer.zero_grad(set_to_none=True)
        if not total:  # no rank has a sample (every group had zero variance): every rank skips
            return {"loss": 0.0, "tokens": 0, "kl": 0.0, "grad_norm": 0.0, "mini_batches": 0}
        parts = mini_batches(samples, share_sizes(total, world), self.topo.rank, job.rl.mini_batches)
        micro = [[pack(chunk, PAD_ID).to(self.device) for chunk in micro_batches(part.samples,
                                                                                 job.parallel.micro_batch_size)]
                 for part in parts]
        stats = UpdateStats()
        behaviour = []
        with torch.no_grad():  # behaviour log-probs once, before the first optimizer step
            for part, batches in zip(parts, micro):
                behaviour.append([])
                for chunk, batch in zip(micro_batches(part.samples, job.parallel.micro_batch_size), batches):
                    old = self._packed_logprobs(self.model, batch)
                    behaviour[-1].append(behaviour_logprobs(batch, old))
                    stats.observe(chunk, batch, old, behaviour[-1][-1])
        guard.beat()
        loss_sum = kl_sum = 0.0
        for part, batches, behave in zip(parts, micro, behaviour):
            if not part.total:  # no rank has a sample in this mini-batch: every rank skips it
                continue
            if not batches:  # peers train on this mini-batch: join DDP's all-reduce with a zero-weight row
                batches = [pack([], PAD_ID).to(self.device)]
                behave = [torch.zeros_like(batches[0].mask)]
            divisor = part.total / world  # DDP averages the ranks' gradients: x world makes it their sum
            for i, (batch, b) in enumerate(zip(batches, behave)):
                last = i == len(batches) - 1
                with contextlib.nullcontext() if last or self.ddp is self.model else self.ddp.no_sync():
                    new = self._packed_logprobs(self.ddp, batch)
                    loss = grpo_objective(new, b, batch, job.rl.clip_eps, divisor)
                    stats.clip(new, b, batch, job.rl.clip_eps)
                    if self.reference is not None:
                        with torch.no_grad():
                            ref = self._packed_logprobs(self.reference, batch)
                        kl = kl_to_reference(new, ref, batch, divisor)
                        loss = loss + job.rl.kl_coef * kl
                        kl_sum += float(kl.detach()) / world
                    loss_sum += float(loss.detach()) / world  # / world: this rank's share of the mean
                    loss.backward()
                guard.beat()
            stats.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                         job.train.grad_clip or float("inf"))))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        steps = len(stats.grad_norms)
        loss_kl = torch.tensor([loss_sum, kl_sum], dtype=torch.float64, device=self.device)
        if world > 1:  # every rank trains this step: the loss of each mini-batch, over all its sequences
            dist.all_reduce(loss_kl)
        return {"loss": float(loss_kl[0]) / max(steps, 1), "kl": float(loss_kl[1]) / max(steps, 1),
                "mini_batches": steps, **stats.result()}


def make_policy(job: JobConfig, topo: Topology, model_dir: Path) -> RLPolicy:
    """train.backend: torch = Policy above (DDP); megatron = rlslurm/megatron/policy.py (same interface;
    Megatron's DDP and distributed optimizer, on the GPU under NCCL or the CPU over gloo)."""
    if job.train.backend == "megatron":
        from rlslurm.megatron.policy import MegatronPolicy

        return MegatronPolicy(job, topo, model_dir)
    return Policy(job, topo, model_dir)


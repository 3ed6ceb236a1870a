"""The trained policy on every trainer rank: one interface, two backends.

    policy = make_policy(job, topo, model_dir)     # rl/loop.py; train.backend: torch (Policy here) or megatron
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
from rlslurm.logprobs import CausalLMScorer
from rlslurm.lora import adapters, inject, is_adapter, merged_state
from rlslurm.memory_meter import MemoryMeter, owned_tensors
from rlslurm.rl.batches import micro_batches, mini_batches, share_sizes
from rlslurm.rl.config import behaviour_forward
from rlslurm.rl.experience import Sample
from rlslurm.rl.objective import Objective, Packed, UpdateStats, behaviour_logprobs, divisors, kl_to_reference, pack
from rlslurm.sync.protocol import Update
from rlslurm.tinymodel import load_hf
from rlslurm.tokenizer import PAD_ID
from rlslurm.train_config import adamw, recompute


class RLPolicy(abc.ABC):
    """What the RL loop (rlslurm/rl/loop.py) and its checkpoints (rlslurm/rl/checkpointing.py) use of a
    policy. Attributes: `model` (an nn.Module, or a view with load_state_dict / save_pretrained: what a
    checkpoint's HF tensors load into and the export saves), `optimizer` (state_dict / load_state_dict;
    a sharded one adds save_shards / load_shards), `tokenizer`, `device`."""

    model: object
    optimizer: object
    tokenizer: object
    device: torch.device
    meter: MemoryMeter
    """Measures this rank's memory per phase (rlslurm/memory_meter.py); the loop starts each step on it."""

    @abc.abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors that train, in Hugging Face names (a tied tensor once): what a checkpoint holds, and what
        the engines serve (with train.lora: the adapters alone, see `served_weights`)."""

    @abc.abstractmethod
    def served_weights(self, full: bool = False) -> dict[str, torch.Tensor]:
        """What a weight sync sends the engines: `weights()`, except with train.lora, where a step's sync sends
        the adapters (the transformers engine holds the same LoRA layers) or the merged weights (vLLM), and
        `full` (the first sync of a start, a replaced engine's) everything the engine serves, so VERIFY checks
        the frozen base it loaded too."""

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
        self.objective = Objective.of(job)  # rl.*: the loss (rlslurm/rl/objective.py), as the Megatron policy's
        model, self.tokenizer = load_hf(model_dir)  # the tokenizer: the controller's, and the export's
        self.device = compute_device()
        self.model = model.float().to(self.device)
        recompute(self.model, job.resolved_memory.recompute)
        self.lora = job.train.lora.enabled
        self._frozen_sums: dict[str, str] | None = None
        if self.lora:  # the adapters alone train (rlslurm/lora.py); self.model stays the HF model
            self.model = inject(self.model, job.train.lora, seed=job.train.seed)
        fused = job.memory.fused_ce
        self.scorer = CausalLMScorer(self.model, fused=fused)  # what DDP differentiates: token log-probs
        self.optimizer = adamw(self.model, job.train)
        self.reference = None
        if job.rl.kl_coef > 0:
            reference, _ = load_hf(model_dir)
            self.reference = CausalLMScorer(reference.float().to(self.device).eval().requires_grad_(False),
                                            fused=fused)
        self.meter = MemoryMeter(self.device, job.diag.memory_every_steps, owned=lambda: owned_tensors(
            self.model, *([self.reference] if self.reference is not None else []), optimizer=self.optimizer))
        with self.meter.tracking():  # DDP's gradient buckets: held all run, allocated here
            self.ddp = DistributedDataParallel(self.scorer) if topo.world_size > 1 else self.scorer

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained tensors in Hugging Face names, a tied tensor once, under its first name (the engine
        dedups the same way: `lm_head.weight` is `model.embed_tokens.weight`); with train.lora the adapters."""
        return adapters(self.model) if self.lora else _once(self.model.state_dict())

    def served_weights(self, full: bool = False) -> dict[str, torch.Tensor]:
        if not self.lora:
            return self.weights()
        if self.job.rollout.engine == "vllm":  # vLLM serves the plain model: the merged weights (rlslurm/lora.py)
            return _once(merged_state(self.model))
        everything = _once(self.model.state_dict())
        if full:
            return everything
        if self._frozen_sums is None:  # the frozen base never changes: its checksums once
            from rlslurm.sync.checksum import checksums

            self._frozen_sums = checksums((n, t) for n, t in everything.items() if not is_adapter(n))
        return Update(self.weights(), self._frozen_sums)

    @staticmethod
    def _packed_logprobs(scorer, batch: Packed) -> torch.Tensor:
        """Log-probability of every token given the ones before it: column t scores token t + 1
        (rlslurm/logprobs.py; memory.fused_ce: without the full-vocab logits)."""
        return scorer(batch.ids(), batch.attention())

    def update(self, samples: list[Sample], guard: PhaseGuard, *, step_total: int | None = None) -> dict:
        """Clipped GRPO updates on this rank's share: rl.mini_batches optimizer steps, each accumulating
        the gradients of forward passes of parallel.micro_batch_size sequences (DDP's all-reduce only
        on the last: `no_sync` before), each the exact mean over its mini-batch's sequences on all ranks
        (rlslurm/rl/batches.py). `step_total` = the step's samples over all ranks (None: this share is all).

        The ratio is pi_theta / pi_behaviour, the behaviour log-probs taken once before the first step. A
        fresh sample (staleness 0) was sampled by these very weights, so its behaviour log-probs are the
        trainer's own (`old`): the first mini-batch's ratio is exactly 1 and its clip idle, the later ones'
        ratio is how far the earlier steps moved (PPO's trust region). With one mini-batch there is no later
        one, and `old` is the training forward's own log-probs, detached: no separate no-grad forward
        (rlslurm/rl/config.py `behaviour_forward`; the plan counts the same). A stale one (rl.max_staleness > 0)
        was sampled by an older policy: its behaviour log-probs are the engine's, and where the policy has
        since moved a token past 1 +- clip_eps in the direction of its advantage, the clip stops the
        gradient, so running ahead cannot compound an update the fresh samples would not make.
        """
        job, world = self.job, self.topo.world_size
        total = len(samples) if step_total is None else step_total
        self.optimizer.zero_grad(set_to_none=True)
        if not total:  # no rank has a sample (every group had zero variance): every rank skips
            return UpdateStats().result()  # the trained step's keys, `trained: false`
        parts = mini_batches(samples, share_sizes(total, world), self.topo.rank, job.rl.mini_batches)
        rows = [micro_batches(part.samples, job.parallel.micro_batch_size) for part in parts]
        micro = [[pack(chunk, PAD_ID).to(self.device) for chunk in chunks] for chunks in rows]
        stats = UpdateStats()
        meter = self.meter
        behaviour: list[list[torch.Tensor | None]] = [[None] * len(batches) for batches in micro]
        if behaviour_forward(job.rl.mini_batches):  # behaviour log-probs once, before the first step
            with torch.no_grad(), meter.measure("forward_backward"):
                for chunks, batches, behave in zip(rows, micro, behaviour):
                    for i, (chunk, batch) in enumerate(zip(chunks, batches)):
                        old = self._packed_logprobs(self.scorer, batch)
                        behave[i] = behaviour_logprobs(batch, old)
                        stats.observe(chunk, batch, old, behave[i], self.objective)
            guard.beat()
        loss_sum = kl_sum = 0.0
        # rl.loss_agg token_mean: each mini-batch's response tokens over every rank (one all-reduce)
        units = divisors(self.objective, parts, world, reduce=dist.all_reduce if world > 1 else None,
                         device=self.device)
        for part, chunks, batches, behave, divisor in zip(parts, rows, micro, behaviour, units):
            if not part.total:  # no rank has a sample in this mini-batch: every rank skips it
                continue
            if not batches:  # peers train on this mini-batch: join DDP's all-reduce with a zero-weight row
                batches, chunks = [pack([], PAD_ID).to(self.device)], [[]]
                behave = [torch.zeros_like(batches[0].mask)]
            for i, (chunk, batch, b) in enumerate(zip(chunks, batches, behave)):
                last = i == len(batches) - 1
                with contextlib.nullcontext() if last or self.ddp is self.scorer else self.ddp.no_sync(), \
                        meter.measure("forward_backward"):
                    new = self._packed_logprobs(self.ddp, batch)
                    if b is None:  # one update (config.behaviour_forward): the behaviour policy is this forward's
                        old = new.detach()
                        b = behaviour_logprobs(batch, old)
                        stats.observe(chunk, batch, old, b, self.objective)
                    loss = self.objective.loss(new, b, batch, divisor)
                    stats.clip(new, b, batch, self.objective)
                    if self.reference is not None:
                        with torch.no_grad():
                            ref = self._packed_logprobs(self.reference, batch)
                        kl = kl_to_reference(new, ref, batch, divisor, self.objective)
                        loss = loss + job.rl.kl_coef * kl
                        kl_sum += float(kl.detach()) / world
                    loss_sum += float(loss.detach()) / world  # / world: this rank's share of the mean
                    loss.backward()
                guard.beat()
            with meter.measure("optimizer"):
                stats.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), job.train.grad_clip or float("inf"))))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        steps = len(stats.grad_norms)
        loss_kl = torch.tensor([loss_sum, kl_sum], dtype=torch.float64, device=self.device)
        if world > 1:  # every rank trains this step: the loss of each mini-batch, over all its sequences
            dist.all_reduce(loss_kl)
        return stats.result(loss=float(loss_kl[0]) / max(steps, 1), kl=float(loss_kl[1]) / max(steps, 1))


def _once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a tensor that several names share (tied embeddings) once, under its first name."""
    out, seen = {}, set()
    for name, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach()
    return out

"""The trained policy on every trainer rank: one interface, two backends.

    policy = make_policy(job, topo, model_dir)     # train.backend: torch (Policy here) or megatron
    stats = policy.update(samples, guard, step_total=len(all_samples))
    weights = policy.weights()                      # {HF name: tensor}: what the engines serve

`RLPolicy` is the contract the RL loop and its checkpoints use, and nothing else: `Policy` (DDP on
torch, the default) and `rlslurm.megatron.policy.MegatronPolicy` both implement it, and
tests/unit/test_policy_contract.py holds both to its methods and arguments (a call the Megatron policy
does not accept fails in CI, not first on a GPU).
"""

from __future__ import annotations

import abc
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from rlslurm.config import JobConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, compute_device
from rlslurm.rl.experience import Sample
from rlslurm.tinymodel import load_hf
from rlslurm.tokenizer import PAD_ID


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
        """One clipped GRPO step on this rank's share `samples`; `step_total` is the step's sample count
        over all ranks (0: no rank trains, every rank skips). Returns the step's stats (loss, tokens, ...)."""


class Policy(RLPolicy):
    """The trained model (DDP), its optimizer and the optional frozen reference for the KL term."""

    def __init__(self, job: JobConfig, topo: Topology, model_dir: Path):
        self.job, self.topo = job, topo
        model, self.tokenizer = load_hf(model_dir)  # the tokenizer: the controller's, and the export's
        self.device = compute_device()
        self.model = model.float().to(self.device)
        self.ddp = DistributedDataParallel(self.model) if topo.world_size > 1 else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=job.train.lr,
                                           weight_decay=job.train.weight_decay)
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

    def update(self, samples: list[Sample], guard: PhaseGuard, *, step_total: int | None = None) -> dict:
        """One clipped policy-gradient step on this rank's share; DDP averages the gradients.

        The ratio is pi_theta / pi_behaviour. A fresh sample (staleness 0) was sampled by these very
        weights, so its behaviour logprobs are the trainer's own (`old`, equal to `new` in value): the
        ratio is exactly 1 and the clip idle. A stale one (rl.max_staleness > 0) was sampled by an older
        policy: its behaviour logprobs are the engine's, and where the policy has since moved a token past
        1 +- clip_eps in the direction of its advantage, the clip stops the gradient (PPO's trust region),
        so running ahead cannot compound an update the fresh samples would not make.
        """
        clip = self.job.rl.clip_eps
        self.optimizer.zero_grad(set_to_none=True)
        if not samples:
            if not step_total:  # no rank has a sample (every group had zero variance): every rank skips
                return {"loss": 0.0, "tokens": 0, "kl": 0.0, "grad_norm": 0.0}
            # Peers train this step: join DDP's all-reduce with a zero loss through the DDP wrapper (its
            # hooks fire only after a forward through it) and take the optimizer step on the averaged
            # gradient like them, or this rank's weights drift away from theirs.
            ids = torch.full((1, 2), PAD_ID, dtype=torch.long, device=self.device)
            loss = self._logprobs(self.ddp, ids, torch.ones_like(ids)).sum() * 0.0
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.job.train.grad_clip or float("inf"))
            self.optimizer.step()
            return {"loss": 0.0, "tokens": 0, "kl": 0.0, "grad_norm": float(grad_norm)}
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        ids = torch.full((len(samples), width), PAD_ID, dtype=torch.long)
        attn = torch.zeros_like(ids)
        loss_mask = torch.zeros((len(samples), width - 1))
        for i, s in enumerate(samples):
            seq = s.prompt_ids + s.response_ids
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            # position t predicts token t+1: response tokens are predicted from len(prompt)-1 on
            loss_mask[i, len(s.prompt_ids) - 1: len(seq) - 1] = 1.0
        ids, attn, loss_mask = ids.to(self.device), attn.to(self.device), loss_mask.to(self.device)
        adv = torch.tensor([s.advantage for s in samples], device=self.device)[:, None]
        with torch.no_grad():
            old = self._logprobs(self.model, ids, attn)
        behaviour = old
        stale = [i for i, s in enumerate(samples) if s.staleness > 0]
        if stale:
            behaviour = old.clone()
            for i in stale:
                s = samples[i]
                behaviour[i, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.engine_logprobs)] = \
                    torch.tensor(s.engine_logprobs, device=self.device)
        new = self._logprobs(self.ddp, ids, attn)
        ratio = torch.exp(new - behaviour)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        tokens = loss_mask.sum().clamp(min=1.0)
        # GRPO's sequence-level mean: every response weighs the same whatever its length, so a long wrong
        # answer does not outvote a short right one.
        per_seq = loss_mask.sum(1).clamp(min=1.0)
        loss = -((surrogate * loss_mask).sum(1) / per_seq).mean()
        kl = torch.tensor(0.0, device=self.device)
        if self.reference is not None:
            with torch.no_grad():
                ref = self._logprobs(self.reference, ids, attn)
            # k3 estimator (Schulman): unbiased, always >= 0
            kl = (((torch.exp(ref - new) - (ref - new) - 1) * loss_mask).sum(1) / per_seq).mean()
            loss = loss + self.job.rl.kl_coef * kl
        guard.beat()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   self.job.train.grad_clip or float("inf"))
        self.optimizer.step()
        guard.beat()
        # The engine sampled a fresh sample with exactly these weights: a gap means a sync or masking bug.
        # A stale sample's gap is how far the policy moved since; the clip fraction says how much it bit.
        fresh = [(i, s) for i, s in enumerate(samples) if s.staleness == 0]
        engine_lp = [lp for _, s in fresh for lp in s.engine_logprobs]
        trainer_lp = [old[i, len(s.prompt_ids) - 1 + j].item() for i, s in fresh for j in range(len(s.engine_logprobs))]
        gap = max((abs(a - b) for a, b in zip(engine_lp, trainer_lp)), default=0.0)
        with torch.no_grad():
            clipped = ((ratio - 1).abs() > clip).float()
            clip_fraction = float((clipped * loss_mask).sum() / tokens)
            drift = float(((old - behaviour).abs() * loss_mask).sum() / tokens)
        return {"loss": float(loss.detach()), "tokens": int(tokens), "kl": float(kl.detach()),
                "grad_norm": float(grad_norm), "engine_trainer_logprob_gap": gap, "clip_fraction": clip_fraction,
                "stale_logprob_drift": drift}


def make_policy(job: JobConfig, topo: Topology, model_dir: Path) -> RLPolicy:
    """train.backend: torch = Policy above (DDP); megatron = rlslurm/megatron/policy.py (same interface,
    GPU only: on CPU it raises an RlslurmError naming the fix)."""
    if job.train.backend == "megatron":
        from rlslurm.megatron.policy import MegatronPolicy

        return MegatronPolicy(job, topo, model_dir)
    return Policy(job, topo, model_dir)


"""`rl:` in a job YAML: the GRPO algorithm."""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    prompts_per_step: int = 16
    """Prompts sampled per RL step."""
    samples_per_prompt: int = 8
    """Responses generated per prompt (the GRPO group size k)."""
    clip_eps: float = 0.2
    """PPO-style clipping of the importance ratio."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; 0 = no reference model."""
    max_staleness: int = 1
    """Policy versions a sample may lag behind the trainer (k): step n + k's rollout and reward run on policy
    n while step n trains (rlslurm/rl/pipeline.py, docs/rl-overlap.md); 0 = synchronous."""
    eval_every: int = 5
    """Steps between two greedy held-out evaluations of the served policy (also at the start and the end)."""
    mini_batches: int = 1
    """Optimizer steps per RL step: the step's samples are cut into this many mini-batches, each one clipped
    update; the behaviour log-probs are taken once, before the first (verl's ppo_mini_batch_size = the step's
    samples / mini_batches; OpenRLHF's train_batch_size). Each mini-batch runs in forward passes of
    parallel.micro_batch_size sequences per rank. Range [1, 1024]."""

    def __post_init__(self):
        check(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        check(self.samples_per_prompt >= 2, "samples_per_prompt",
              "must be >= 2 (GRPO normalises rewards within a group)")
        check(0 < self.clip_eps < 1, "clip_eps", "must be in (0, 1)")
        check(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        check(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        check(self.eval_every >= 1, "eval_every", "must be >= 1")
        check(1 <= self.mini_batches <= 1024, "mini_batches", "must be in [1, 1024] (optimizer steps per RL step)")

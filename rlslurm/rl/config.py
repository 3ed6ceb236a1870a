"""`rl:` in a job YAML: the GRPO algorithm."""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.configfile import check, check_range


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    prompts_per_step: int = 16
    """Prompts sampled per RL step. Range [1, 100000]."""
    samples_per_prompt: int = 8
    """Responses generated per prompt (the GRPO group size k). Range [2, 4096]."""
    clip_eps: float = 0.2
    """PPO-style clipping of the importance ratio. Range (0, 1)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; 0 = no reference model. Range [0, 100]."""
    max_staleness: int = 1
    """Policy versions a sample may lag behind the trainer (k): step n + k's rollout and reward run on policy
    n while step n trains (rlslurm/rl/pipeline.py, docs/rl-overlap.md); 0 = synchronous. Range [0, 100]."""
    eval_every: int = 5
    """Steps between two greedy held-out evaluations of the served policy (also at the start and the end).
    Range [1, 1e8]."""
    eval_rows: int = 1000
    """Held-out rows each evaluation decodes greedily and scores (the first ones of data.eval, or of the task's
    held-out split): a bound on its time however large the split. Range [1, 1000000]."""
    mini_batches: int = 1
    """Optimizer steps per RL step: the step's samples are cut into this many mini-batches, each one clipped
    update; the behaviour log-probs are taken once, before the first (verl's ppo_mini_batch_size = the step's
    samples / mini_batches; OpenRLHF's train_batch_size). Each mini-batch runs in forward passes of
    parallel.micro_batch_size sequences per rank. Range [1, 1024]."""

    def __post_init__(self):
        check_range(self.prompts_per_step, "prompts_per_step", 1, 100_000)
        check_range(self.samples_per_prompt, "samples_per_prompt", 2, 4096,
                    note="GRPO normalises rewards within a group")
        check(0 < self.clip_eps < 1, "clip_eps", "must be in (0, 1)")
        check_range(self.kl_coef, "kl_coef", 0, 100)
        check_range(self.max_staleness, "max_staleness", 0, 100, note="policy versions")
        check_range(self.eval_every, "eval_every", 1, 10**8, note="steps")
        check_range(self.eval_rows, "eval_rows", 1, 1_000_000, note="rows")
        check_range(self.mini_batches, "mini_batches", 1, 1024, note="optimizer steps per RL step")

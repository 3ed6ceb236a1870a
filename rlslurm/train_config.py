"""`train:` in a job YAML: what both entrances (SFT and RL) share on the trainer side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlslurm.configfile import check, check_path, check_range
from rlslurm.lora import LoraConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    backend: Literal["torch", "megatron"] = "torch"
    """torch = DDP trainer on the HF model; megatron = Megatron-core's GPTModel, DDP and distributed optimizer
    (rlslurm/megatron/: sft.py for job.kind sft, policy.py for rl), on the GPU or over gloo on the CPU."""
    steps: int = 20
    """Optimizer steps the job runs in total (across requeues). Range [1, 1e8]."""
    lr: float = 1e-3
    """Peak learning rate. Range (0, 10]."""
    batch_size: int = 32
    """Sequences per optimizer step across all data-parallel ranks (SFT and toy jobs; an RL step is
    rl.prompts_per_step x rl.samples_per_prompt). Range [1, 1000000]."""
    grad_clip: float = 1.0
    """Gradient-norm clipping; 0 = off. Range [0, 1000000]."""
    init_from: str | None = None
    """HF-layout safetensors checkpoint to start from (a directory path); null = the embedded model at random init."""
    seed: int = 0
    """Seed of every RNG (data order, init, sampling). Range [0, 4294967295]."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: constant = stay at train.lr; cosine = decay to 0 at train.steps (SFT)."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to train.lr (SFT), fewer than train.steps. Range [0, 1e8]."""
    stop_at_accuracy: float | None = None
    """SFT: stop once greedy accuracy on the task's dev split (task.dev_size) reaches this, checked every
    train.eval_every_steps; train.steps is then the most steps. Where a run stops on a steep learning curve
    moves with the CPU's kernel path and the seed; a target does not. null = run train.steps. Range (0, 1]."""
    eval_every_steps: int = 25
    """SFT: optimizer steps between two dev-split evaluations of train.stop_at_accuracy. Range [1, 1e8]."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay of the weight matrices (not of norms and biases, as Megatron-core's
    optimizer does too). Range [0, 10]."""
    dist_timeout_s: float = 1800.0
    """Seconds a rank waits for its peers in the process group (join and collectives) before failing; it must
    outlast the watchdog (the longest trainer phase timeout of diag + one poll), which names the hung rank
    while its peers still wait (torch's own default, 1,800 s). Range (0, 86400]."""
    step_delay_s: float = 0.0
    """Idle seconds per step standing in for compute (toy, sft and rl jobs), so spine tests can signal mid-run.
    Range [0, 3600]."""
    exit_grace_s: float = 120.0
    """Seconds a trainer rank may outlive rank 0's clean exit (0 only after the final barrier every rank
    reached, so the job's work is done) before it is named (`rank_outlived_job`, its stack dumped) and ended:
    a teardown that hangs (gloo's destructor waiting on work a gone peer never matches) never holds a finished
    job. Range (0, 86400]."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (rank > 0; rlslurm/lora.py): the torch trainer (SFT and RL) trains,
    checkpoints and syncs the adapters alone, the exports are merged plain HF models. train.backend megatron
    refuses it."""
    max_restarts: int = 2
    """Restarts of the trainer ranks inside one SLURM allocation after a rank dies by a signal (SIGKILL,
    segfault, OOM kill): a new job step on the same nodes, resumed from the newest complete checkpoint, the
    engines kept (rlslurm/slurm/supervisor.py). Past it, or with a node lost, the job is requeued. 0 = never
    restart inside the allocation. Range [0, 100]."""

    def __post_init__(self):
        check_range(self.steps, "steps", 1, 10**8)
        check_range(self.lr, "lr", 0, 10, low_open=True)
        check_range(self.batch_size, "batch_size", 1, 1_000_000)
        check_range(self.grad_clip, "grad_clip", 0, 1_000_000)
        check_path(self.init_from, "init_from")
        check_range(self.seed, "seed", 0, 2**32 - 1)
        check_range(self.warmup_steps, "warmup_steps", 0, 10**8)
        check(0 <= self.warmup_steps < self.steps, "warmup_steps",
              f"must be >= 0 and less than train.steps = {self.steps}")
        check_range(self.weight_decay, "weight_decay", 0, 10)
        if self.stop_at_accuracy is not None:
            check_range(self.stop_at_accuracy, "stop_at_accuracy", 0, 1, low_open=True)
        check_range(self.eval_every_steps, "eval_every_steps", 1, 10**8)
        check_range(self.dist_timeout_s, "dist_timeout_s", 0, 86_400, low_open=True, note="seconds")
        check_range(self.step_delay_s, "step_delay_s", 0, 3600, note="seconds")
        check_range(self.max_restarts, "max_restarts", 0, 100)
        check_range(self.exit_grace_s, "exit_grace_s", 0, 86_400, low_open=True, note="seconds")


def adamw(model, train: TrainConfig):
    """The torch trainers' AdamW at train.lr: weight decay on matrices only, the parameter groups Megatron-core
    builds (a 1-D parameter or a bias keeps wd_mult 0), so both backends decay the same tensors. With no decay,
    one group, as optimizer states saved before this split hold."""
    import torch  # here, not at the top: the CLI reads configs without loading torch

    # Only what trains: with train.lora the frozen base has no moments (Adam's state is the adapters' alone).
    if train.weight_decay == 0:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=train.lr, weight_decay=0.0)
    decayed, plain = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (plain if p.ndim == 1 or name.endswith(".bias") else decayed).append(p)
    return torch.optim.AdamW([{"params": decayed, "weight_decay": train.weight_decay},
                              {"params": plain, "weight_decay": 0.0}], lr=train.lr)


def recompute(model, mode: str) -> None:
    """memory.recompute on a transformers model: full = gradient checkpointing of every layer (non-reentrant,
    which DDP takes); none and selective keep every activation (SDPA keeps no attention scores to drop)."""
    if mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers checkpoints only in training mode (the Llama has no dropout to switch on)

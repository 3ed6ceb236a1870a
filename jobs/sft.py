"""The SFT entrance: supervised training on the task's train split with DDP, then an HF export.

Run one rank by hand (rank, world and master come from the environment, see rlslurm/dist.py):

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python -m rlslurm.jobs.sft --config examples/tiny-sft.yaml --run-dir runs/sft &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python -m rlslurm.jobs.sft --config examples/tiny-sft.yaml --run-dir runs/sft

Each rank calls `run_sft(job, run_dir)`: join the process group (gloo on CPU, NCCL on GPU), build the
same model from train.seed (or load train.init_from), train train.steps optimizer steps on a data order
fixed by train.seed, then rank 0 writes <run>/export/hf (config.json, model.safetensors,
generation_config.json, tokenizer files) atomically — the directory an RL job's `train.init_from` names
and a vLLM engine loads — and records the greedy held-out accuracy in <run>/metrics.jsonl.

Everything a resume needs (model, optimizer, schedule, RNG, step; the data position follows from the
step) is in `SFTState`, whose state_dict() a checkpoint saves.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlslurm.config import JobConfig, load_config
from rlslurm.dist import Topology, init_process_group
from rlslurm.errors import ConfigError, RlslurmError
from rlslurm.evaluate import greedy_accuracy
from rlslurm.events import emit
from rlslurm.rundir import RunDir
from rlslurm.tasks.arithmetic import Problem, make_splits
from rlslurm.tinymodel import build_model, load_hf, save_hf
from rlslurm.tokenizer import EOS_ID, PAD_ID, build_tokenizer
from rlslurm.train_config import TrainConfig

IGNORE = -100  # label value the HF loss skips: prompt and padding positions


def encode(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one example; only the answer and </s> are learned."""
    prompt = tokenizer(problem.prompt)["input_ids"]
    target = tokenizer(problem.target, add_special_tokens=False)["input_ids"] + [EOS_ID]
    return prompt + target, [IGNORE] * len(prompt) + target


def collate(examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad a batch; padding sits after every real token, so causal attention never sees it."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)], labels[row, : len(y)], mask[row, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def batch_indices(n_examples: int, global_batch: int, seed: int, step: int, rank: int, world: int) -> list[int]:
    """This rank's example indices for `step`: a pure function, so a resumed job continues the same order.

    The stream is epoch after epoch of permutations seeded by (seed, epoch); a global batch is the next
    `global_batch` positions of it, dealt round-robin to the ranks.
    """
    out = []
    for position in range(step * global_batch + rank, (step + 1) * global_batch, world):
        epoch, offset = divmod(position, n_examples)
        out.append(int(_permutation(n_examples, seed, epoch)[offset]))
    return out


_PERMS: dict[tuple[int, int, int], torch.Tensor] = {}


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    key = (n, seed, epoch)
    if key not in _PERMS:
        _PERMS.clear()  # one epoch at a time is all a run touches
        _PERMS[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return _PERMS[key]


def lr_factor(train: TrainConfig, step: int) -> float:
    """Multiplier of train.lr at `step`: linear warmup, then constant or cosine to 0."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return 1.0
    progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class SFTState:
    """The whole training state in one place: what a checkpoint saves and a resume restores."""

    model: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int = 0
    """Optimizer steps done; also the data position (see batch_indices)."""

    def state_dict(self) -> dict:
        return {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])


def weights_sha256(model: torch.nn.Module) -> str:
    """One checksum over every named tensor, to show that ranks (and an export) hold the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(getattr(model, "module", model).state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def build_state(job: JobConfig, topo: Topology) -> SFTState:
    if job.train.init_from:
        model, _ = load_hf(job.train.init_from)
        model.train()
    else:
        model = build_model(job.model, seed=job.train.seed)
    # DDP broadcasts rank 0's weights at construction, so ranks start equal even if init differed.
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=job.train.lr, weight_decay=job.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(job.train, s))
    return SFTState(model=ddp, optimizer=optimizer, scheduler=scheduler)


def train_step(state: SFTState, batch: dict[str, torch.Tensor], grad_clip: float) -> tuple[float, float]:
    """One optimizer step; returns (loss averaged over ranks, gradient norm before clipping)."""
    loss = state.model(**batch).loss
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = state.model.parameters()
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    state.optimizer.step()
    state.scheduler.step()
    state.step += 1
    reported = loss.detach().clone()
    dist.all_reduce(reported, op=dist.ReduceOp.SUM)
    return reported.item() / dist.get_world_size(), float(norm)


def run_sft(job: JobConfig, run_dir: Path) -> dict:
    """Train, export and evaluate as one rank of the SFT job; returns this rank's summary."""
    started = time.time()
    run = RunDir(Path(run_dir)).create()
    topo = Topology.detect()
    train = job.train
    if train.batch_size % topo.world_size:
        raise ConfigError(f"train.batch_size = {train.batch_size} must be divisible by the "
                          f"{topo.world_size} data-parallel ranks of this job")
    _set_cpu_threads(topo)
    init_process_group(topo, timeout_s=train.dist_timeout_s)
    try:
        tokenizer = build_tokenizer()
        train_set, held_out = make_splits(job.task)
        examples = [encode(tokenizer, p) for p in train_set]
        longest = max(len(ids) for ids, _ in examples) + job.rollout.max_new_tokens
        if longest > job.model.max_positions:
            raise ConfigError(f"model.max_positions = {job.model.max_positions} is shorter than a prompt plus "
                              f"rollout.max_new_tokens = {job.rollout.max_new_tokens} ({longest} tokens)")
        torch.manual_seed(train.seed + topo.rank)
        state = build_state(job, topo)
        emit(run, "sft_start", role="trainer", rank=topo.rank, world_size=topo.world_size,
             steps=train.steps, params=sum(p.numel() for p in state.model.parameters()))
        while state.step < train.steps:
            t0 = time.perf_counter()
            idx = batch_indices(len(examples), train.batch_size, train.seed, state.step, topo.rank, topo.world_size)
            lr = state.scheduler.get_last_lr()[0]
            loss, grad_norm = train_step(state, collate([examples[i] for i in idx]), train.grad_clip)
            if topo.is_main:
                run.append_json(run.metrics, {"t": time.time(), "kind": "sft_step", "step": state.step,
                                              "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                              "step_s": time.perf_counter() - t0})
        checksum = weights_sha256(state.model)
        summary = {"rank": topo.rank, "step": state.step, "weights_sha256": checksum}
        if topo.is_main:
            summary.update(_export_and_evaluate(job, run, state, tokenizer, held_out, started))
        # Peers wait for the export so that every rank leaves only once the job's output exists.
        dist.barrier()
        emit(run, "sft_finished", role="trainer", **summary)
        return summary
    finally:
        dist.destroy_process_group()


def _export_and_evaluate(job, run, state, tokenizer, held_out, started) -> dict:
    export = save_hf(state.model, run.path / "export" / "hf", max_new_tokens=job.rollout.max_new_tokens)
    emit(run, "sft_export", role="trainer", rank=0, path=str(export), step=state.step)
    result = greedy_accuracy(state.model, tokenizer, held_out, max_new_tokens=job.rollout.max_new_tokens)
    record = {"heldout_accuracy": result.accuracy, "heldout_correct": result.correct,
              "heldout_total": result.total, "export": str(export), "wall_s": time.time() - started}
    run.append_json(run.metrics, {"t": time.time(), "kind": "sft_eval", "step": state.step, **record})
    return record


def _set_cpu_threads(topo: Topology) -> None:
    # torch takes every core per process by default; N ranks on one CPU host would then oversubscribe
    # it N times over and run slower than one rank. An explicit OMP_NUM_THREADS wins.
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // topo.world_size))


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Job YAML.")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="The run directory.")
def main(config_path: str, run_dir: str) -> None:
    """Run one rank of the SFT job (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        summary = run_sft(load_config(config_path), Path(run_dir))
    except RlslurmError as e:
        click.echo(f"rlslurm sft: {e}", err=True)
        sys.exit(e.exit_code)
    click.echo(" ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()

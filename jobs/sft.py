"""The SFT entrance: supervised training on the job's rows (data.train, or task:'s generated arithmetic) with
DDP, then an HF export.

Two trainers behind one loop (train.backend): torch (`SFTState` here: DDP + AdamW on the HF model) and
megatron (rlslurm/megatron/sft.py's `MegatronSFTState`: Megatron-core's DDP, distributed optimizer and
schedule); both start from the same weights and learn the same loss, checkpoint, drain, resume and export
the same way.

Run one rank by hand (rank, world and master come from the environment, see rlslurm/dist.py):

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python -m rlslurm.jobs.sft --config examples/tiny-sft.yaml --run-dir runs/sft &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python -m rlslurm.jobs.sft --config examples/tiny-sft.yaml --run-dir runs/sft

Each rank calls `run_sft(job, run_dir)`: join the process group (gloo on CPU, NCCL on GPU), build the same model
from train.seed (or load train.init_from), train train.steps optimizer steps on a data order fixed by train.seed
(rlslurm/data/: the rows as Samples, prompt text or chat messages, the loss on the completion tokens only; rows past
model.max_positions dropped or cut per data.too_long and counted), then rank 0 writes <run>/export/hf (config.json,
model.safetensors, generation_config.json, tokenizer files) atomically — the directory an RL job's `train.init_from`
names and a vLLM engine loads — and records the held-out result in <run>/metrics.jsonl: greedy accuracy on the task,
completion loss on a user's data.

Stop and come back like every entrance (rlslurm/lifecycle.py): checkpoints every `checkpoint.*` interval through
rlslurm/checkpoint.py; on a drain (SIGUSR1, SIGTERM, <run>/control/drain) all ranks stop at one step boundary
(rlslurm/boundary.py), checkpoint, requeue and exit 75; a start resumes from the newest complete checkpoint.
Everything a resume needs (model, optimizer, schedule, every rank's RNG, step) is in `SFTState`, and the data
position (epoch, index) is in the checkpoint's trainer.json beside it, so a resumed run ends with the same losses
and weights as one that never stopped. The phase guard (diag/guard.py) wraps every phase: start, data, train,
checkpoint, export.
"""

from __future__ import annotations

import contextlib
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

from rlslurm import lifecycle, lora, plan_vs_run
from rlslurm.boundary import StepBoundary
from rlslurm.checkpoint import Checkpoint, CheckpointWriter, step_dirname
from rlslurm.config import JobConfig, load_config
from rlslurm.data.layout import DataError, RowError
from rlslurm.data.sampler import Sampler
from rlslurm.data.splits import load_splits
from rlslurm.data.table import BadRows, SampleTable
from rlslurm.data.tokens import collate, encode, fit, job_tokenizer
from rlslurm.diag.drain_gate import DrainGate
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, compute_device, init_process_group, release_process_group_users
from rlslurm.errors import CheckpointError, ConfigError, RlslurmError
from rlslurm.events import DATA_ROWS_SKIPPED, SFT_EXPORT, SFT_FINISHED, SFT_START, emit
from rlslurm.jobs.sft_eval import StopAtTarget, evaluate_export
from rlslurm.lifecycle import ExitCode
from rlslurm.logprobs import CausalLMScorer, sft_loss
from rlslurm.memory_meter import MemoryMeter, owned_tensors, step_memory
from rlslurm.metrics_sinks import MetricsLog
from rlslurm.rundir import RunDir
from rlslurm.tinymodel import build_model, load_hf, save_hf
from rlslurm.train_config import TrainConfig, adamw, recompute


def batch_indices(n_examples: int, global_batch: int, seed: int, step: int, rank: int, world: int) -> list[int]:
    """This rank's example indices for `step` when each step takes `global_batch` positions: a pure function,
    so a resumed job continues the same order (rlslurm/data/sampler.py: epochs of permutations seeded by
    (seed, epoch); a global batch is the next `global_batch` positions, dealt round-robin to the ranks)."""
    return Sampler(n_examples, seed).indices(step * global_batch + rank, global_batch - rank, world)


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
    """The whole training state in one place: what a checkpoint saves and a resume restores (torch backend;
    rlslurm/megatron/sft.py's MegatronSFTState has the same methods)."""

    model: DistributedDataParallel
    """DDP around rlslurm/logprobs.py's CausalLMScorer of the HF model (`lm`): the token log-probs it
    differentiates, with or without the full-vocab logits (memory.fused_ce)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    meter: MemoryMeter
    """This rank's memory per phase (rlslurm/memory_meter.py); the loop starts each step on it."""
    grad_clip: float = 0.0
    """train.grad_clip (0 = off)."""
    micro_batch_size: int = 1 << 30
    """parallel.micro_batch_size: rows per forward + backward; a larger batch accumulates gradients."""
    step: int = 0
    """Optimizer steps done; also the data position (see batch_indices)."""

    @property
    def lm(self) -> torch.nn.Module:
        """The HF model being trained (what checkpoints, evaluation and the export read)."""
        return self.model.module.lm

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.scheduler.get_last_lr()[0]

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def train_step(self, batch: dict[str, torch.Tensor], beat=lambda: None) -> tuple[float, float]:
        """One optimizer step; returns (loss averaged over ranks, gradient norm before clipping).
        `beat` is the phase guard's progress call, made from inside the step."""
        device = compute_device()
        ids, mask, labels = (batch[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
        # The loss is the mean over this rank's learned tokens however the rows are cut into micro-batches:
        # each one's sum of log-likelihoods over the batch's token count (DDP all-reduces on the last only).
        tokens = (labels[:, 1:] != -100).sum().clamp(min=1)
        size = self.micro_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device)
        with self.meter.measure("forward_backward"):
            for start in range(0, ids.shape[0], size):
                rows = slice(start, start + size)
                width = int(mask[rows].sum(1).max())  # right padding: no row of this cut is longer
                last = start + size >= ids.shape[0]
                with contextlib.nullcontext() if last else self.model.no_sync():
                    cut = (ids[rows, :width], mask[rows, :width], labels[rows, :width])
                    part = sft_loss(self.model(*cut), cut[2], tokens=tokens)
                    part.backward()
                loss += part.detach()
                beat()
        with self.meter.measure("optimizer"):
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                  self.grad_clip if self.grad_clip > 0 else float("inf"))
            self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        reported = loss.detach().clone()
        dist.all_reduce(reported, op=dist.ReduceOp.SUM)
        return reported.item() / dist.get_world_size(), float(norm)

    def weights_sha256(self) -> str:
        return weights_sha256(self.lm)

    def eval_model(self):
        """Collective: the model as a transformers module on rank 0 (what `greedy_accuracy` decodes), None on the
        other ranks."""
        return self.lm if dist.get_rank() == 0 else None

    def export(self, directory: Path, max_new_tokens: int):
        """Rank 0: (path, the trained model) after writing the HF directory; the other ranks (None, None)."""
        if not dist.get_rank() == 0:
            return None, None
        return save_hf(self.lm, directory, max_new_tokens=max_new_tokens), self.lm

    def save(self, run: RunDir, topo: Topology, keep: int, trainer: dict | None = None) -> float:
        """Collective: every rank's RNG is gathered, rank 0 writes; the save's seconds on every rank.
        `trainer`: more of the loop's state for the checkpoint's trainer.json (the data position)."""
        rngs: list = [None] * topo.world_size
        dist.all_gather_object(rngs, torch.get_rng_state())
        seconds = [0.0]
        if topo.is_main:
            with CheckpointWriter(run, self.step, keep=keep,
                                  metadata={"job": "sft", "world_size": topo.world_size}) as ckpt:
                ckpt.save_tensors("model", _trained_tensors(self.lm))
                ckpt.save_state("optimizer", self.optimizer.state_dict())
                ckpt.save_state("scheduler", self.scheduler.state_dict())
                ckpt.save_state("rng", rngs)
                ckpt.save_json("trainer", {"step": self.step, **(trainer or {})})
            seconds = [ckpt.saved.seconds]
        dist.broadcast_object_list(seconds, src=0)
        return seconds[0]

    def load(self, ckpt: Checkpoint, topo: Topology) -> None:
        """Every rank reads the checkpoint (shared filesystem) and takes its own RNG stream back."""
        tensors = ckpt.load_tensors("model")
        missing, unexpected = self.lm.load_state_dict(tensors, strict=False)
        tied = set(self.lm.state_dict()) - set(_trained_tensors(self.lm))  # tied, or (train.lora) the frozen base
        if unexpected or set(missing) - tied:
            raise CheckpointError(f"{ckpt.path}: model tensors do not fit this model (missing "
                                  f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)})")
        self.optimizer.load_state_dict(ckpt.load_state("optimizer"))
        self.scheduler.load_state_dict(ckpt.load_state("scheduler"))
        rngs = ckpt.load_state("rng")
        if len(rngs) != topo.world_size:
            raise CheckpointError(f"{ckpt.path} holds the RNG of {len(rngs)} ranks, this job has {topo.world_size}")
        torch.set_rng_state(rngs[topo.rank])
        self.step = int(ckpt.load_json("trainer")["step"])


def _unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with a tied tensor once, under its first name: safetensors refuses shared storage
    (tied embeddings: `lm_head.weight` is `model.embed_tokens.weight`), and loading it fills both."""
    out, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor
    return out


def _trained_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds: every tensor once, or with train.lora the adapters alone (the frozen base is
    train.init_from, or the seeded init, read again at every start)."""
    return lora.adapters(model) if lora.has_lora(model) else _unique_tensors(model)


def weights_sha256(model: torch.nn.Module) -> str:
    """One checksum over every named tensor, to show that ranks (and an export) hold the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(getattr(model, "module", model).state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def build_state(job: JobConfig, topo: Topology):
    """The training state of train.backend: SFTState (torch) or rlslurm/megatron/sft.py's MegatronSFTState."""
    if job.train.backend == "megatron":
        from rlslurm.megatron.sft import MegatronSFTState

        return MegatronSFTState(job, topo, lambda step: job.train.lr * lr_factor(job.train, step))
    if job.train.init_from:
        model, _ = load_hf(job.train.init_from)
        model.train()
    else:
        model = build_model(job.model, seed=job.train.seed)
    model = model.to(compute_device())
    recompute(model, job.resolved_memory.recompute)
    if job.train.lora.enabled:  # the adapters alone train, are checkpointed; the export is merged (rlslurm/lora.py)
        model = lora.inject(model, job.train.lora, seed=job.train.seed)
    optimizer = adamw(model, job.train)
    meter = MemoryMeter(compute_device(), job.diag.memory_every_steps,
                        owned=lambda: owned_tensors(model, optimizer=optimizer))
    with meter.tracking():  # DDP's gradient buckets: held all run, allocated here
        # DDP broadcasts rank 0's weights at construction, so ranks start equal even if init differed.
        ddp = DistributedDataParallel(CausalLMScorer(model, fused=job.memory.fused_ce))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(job.train, s))
    return SFTState(model=ddp, optimizer=optimizer, scheduler=scheduler, meter=meter, grad_clip=job.train.grad_clip,
                    micro_batch_size=job.parallel.micro_batch_size)


def run_sft(job: JobConfig, run_dir: Path, *, requeue=lifecycle.requeue_job) -> dict:
    """Train (or resume), export and evaluate as one rank of the SFT job; returns this rank's summary.

    `summary["exit_code"]` is the lifecycle code: DONE, DRAINED (checkpointed and requeued; run again to
    resume) or NO_PROGRESS (the requeue-storm guard stopped it).
    """
    started = time.time()
    run = RunDir(Path(run_dir)).create()
    topo = Topology.detect()
    train = job.train
    if train.batch_size % topo.world_size:
        raise ConfigError(f"train.batch_size = {train.batch_size} must be divisible by the "
                          f"{topo.world_size} data-parallel ranks of this job")
    _set_cpu_threads(topo)
    gate = DrainGate(run, poll_interval_s=0.5, kill_wait_s=job.checkpoint.kill_wait_s)
    gate.install_signal_handlers()
    metrics = MetricsLog(run, job.logging)  # rank 0 appends: metrics.jsonl, then TensorBoard / W&B if on
    try:
        # Guarded from before the rendezvous: a rank that never joins shows up stuck in phase "start".
        with PhaseGuard(run, "train", topo.rank, job.diag, gate=gate, job_id=lifecycle.leader_job_id()) as guard:
            init_process_group(topo, timeout_s=train.dist_timeout_s)
            try:
                summary = _train(job, run, topo, gate, guard, started, requeue, metrics)
                # Leave together: every rank exits only once the job's output (export, checkpoint) exists.
                dist.barrier()
                release_process_group_users()
            finally:
                dist.destroy_process_group()
        return summary
    finally:
        metrics.close()
        gate.restore_signal_handlers()


def _train(job: JobConfig, run: RunDir, topo: Topology, gate: DrainGate, guard: PhaseGuard, started: float,
           requeue, metrics: MetricsLog) -> dict:
    train = job.train
    tokenizer = job_tokenizer(job)
    train_rows, held_out = load_splits(job)
    if job.data.train is None:
        # The generated task: every row is short and known up front, so the whole set is checked here.
        longest = max(len(encode(tokenizer, train_rows.sample(i))[0]) for i in range(len(train_rows)))
        longest += job.rollout.max_new_tokens
        if longest > job.model.max_positions:
            raise ConfigError(f"model.max_positions = {job.model.max_positions} is shorter than a prompt plus "
                              f"rollout.max_new_tokens = {job.rollout.max_new_tokens} ({longest} tokens)")
    sampler = Sampler(len(train_rows), train.seed)
    bad_rows = BadRows(job.data.max_bad_share)  # rows drawn, rows skipped as bad: past the share the job stops
    torch.manual_seed(train.seed + topo.rank)
    state = build_state(job, topo)
    path, proceed = lifecycle.agree_on_start(run, is_main=topo.is_main,
                                             max_no_progress_restarts=job.checkpoint.max_no_progress_restarts)
    if not proceed:
        return {"rank": topo.rank, "step": None, "exit_code": ExitCode.NO_PROGRESS}
    position = 0  # the data position: rows drawn so far (sampler.state saves it as epoch, index)
    if path:
        ckpt = Checkpoint.open(Path(path), verify=False)  # rank 0 verified it in latest_complete
        state.load(ckpt, topo)
        saved = ckpt.load_json("trainer").get("data") or {}
        try:
            # A checkpoint from before the data layer: each step took train.batch_size positions.
            position = sampler.position(saved) if saved else state.step * train.batch_size
            bad_rows.drawn, bad_rows.bad = int(saved.get("drawn", 0)), int(saved.get("bad", 0))
        except ValueError as e:
            raise CheckpointError(f"{ckpt.path}: {e}; resume with the data and train.seed it was written "
                                  "with") from None
    emit(run, SFT_START, role="trainer", rank=topo.rank, world_size=topo.world_size, steps=train.steps,
         start_step=state.step, params=state.params(), device=str(state.device), backend=train.backend)
    boundary = StepBoundary(run, topo, gate, job, start_step=state.step, requeue=requeue)
    policy = boundary.interval
    last_saved = state.step if path else None

    def save() -> str:
        nonlocal last_saved
        if last_saved != state.step:
            with guard.phase("checkpoint", step=state.step):
                policy.observe_save(state.step, state.save(run, topo, job.checkpoint.keep,
                                                           trainer={"data": {**sampler.state(position),
                                                                                    **bad_rows.state()}}))
            last_saved = state.step
        return step_dirname(state.step)

    target = StopAtTarget(job, metrics, tokenizer)
    while True:
        # Step boundary (rlslurm/boundary.py): every rank agrees to drain, save or stop at the same step.
        at = boundary.agree(state.step, stop=target.reached(state, guard))  # the target: rank 0 decodes the dev split
        if at.drain:
            return {"rank": topo.rank, "step": state.step, "exit_code": boundary.drain(state.step, at, save)}
        if at.checkpoint_due:
            save()
        if at.stop or state.step >= train.steps:
            break
        t0 = time.perf_counter()
        with guard.phase("data", step=state.step + 1):
            idx = sampler.indices(position + topo.rank, train.batch_size - topo.rank, topo.world_size)
            batch, skipped = _batch(job, run, tokenizer, train_rows, idx, state.step + 1, topo.rank, bad_rows)
            position += train.batch_size
        lr = state.lr()
        metered = state.meter.start_step(state.step + 1)
        with guard.phase("train", step=state.step + 1):
            loss, grad_norm = state.train_step(batch, beat=guard.beat)
        step_s = time.perf_counter() - t0
        policy.observe_step(step_s)
        memory = None
        if metered:  # every rank meters the same steps (by step number), so every rank joins this gather
            memory = [None] * topo.world_size
            dist.all_gather_object(memory, state.meter.peaks())
        if topo.is_main:
            metrics.append({"t": time.time(), "kind": "sft_step", "step": state.step, "loss": loss, "lr": lr,
                            "grad_norm": grad_norm, "step_s": step_s, "rows_skipped": skipped,
                            **step_memory(memory)})
            if state.step == min(plan_vs_run.CHECK_STEP, train.steps):  # the run meets its plan, once
                plan_vs_run.check(run, state.step)
        if train.step_delay_s:
            with guard.phase("train", step=state.step):
                time.sleep(train.step_delay_s)  # stands in for compute: tests signal mid-run
    # The trained state, checkpointed before the export: a restart after this point only re-exports.
    save()
    checksum = state.weights_sha256()
    summary = {"rank": topo.rank, "step": state.step, "weights_sha256": checksum,
               "stopped_by": "stop_at_accuracy" if state.step < train.steps else "steps"}
    with guard.phase("export", step=state.step):
        # Every rank: the Megatron export gathers over TP; rank 0 writes it and evaluates it.
        export, model = state.export(run.path / "export" / "hf", job.rollout.max_new_tokens)
        if topo.is_main:
            emit(run, SFT_EXPORT, role="trainer", rank=0, path=str(export), step=state.step)
            summary.update(evaluate_export(job, metrics, state.step, export, model, tokenizer, held_out, started))
        # Peers wait for the export so that no rank reports finished before the job's output exists.
        dist.barrier()
    emit(run, SFT_FINISHED, role="trainer", **summary)
    return {**summary, "exit_code": ExitCode.DONE}


def _batch(job: JobConfig, run: RunDir, tokenizer, rows: SampleTable, idx: list[int], step: int, rank: int,
           bad_rows: BadRows):
    """This rank's batch of rows `idx`, and what it skipped (rows over model.max_positions, dropped or cut
    under data.too_long; rows that break the layout's rules: counted in `bad_rows`, BadRowShareError past
    data.max_bad_share on every rank at once), counted over every rank in the step's metrics."""
    examples, too_long, truncated, bad, reason, bad_reason = [], 0, 0, 0, None, None
    for i in idx:
        sample = rows.try_sample(i)
        if isinstance(sample, RowError):
            bad += 1
            bad_reason = f"{rows.source}: row {rows.file_row(i)}, column {sample.column!r}: {sample.message}"
            reason = reason or bad_reason
            continue
        example = encode(tokenizer, sample)
        kept = fit(example, job.model.max_positions, job.data.too_long)
        if kept is None:
            too_long += 1
            reason = reason or (f"{rows.source}: row {rows.file_row(i)} is {len(example[0])} tokens; "
                                f"model.max_positions = {job.model.max_positions}")
        elif kept is not example:
            truncated += 1
        if kept is not None:
            examples.append(kept)
    counts = torch.tensor([too_long, truncated, bad, 0 if examples else 1], dtype=torch.long,
                          device=compute_device())
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    too_long, truncated, bad, empty = (int(c) for c in counts)
    bad_rows.add(job.train.batch_size, bad, bad_reason or ("a row of a peer rank's share" if bad else None))
    if empty:
        raise DataError(f"step {step}: every training row of a rank's batch was left out ({reason or 'on a peer'}); "
                        "check the rows with `rlslurm validate`, or set data.too_long = truncate")
    skipped = {"too_long": too_long, "truncated": truncated, "bad_rows": bad}  # every step's row: zeros too
    if too_long + truncated + bad and rank == 0:
        emit(run, DATA_ROWS_SKIPPED, role="trainer", step=step, **skipped,
             **({"first_reason": reason} if reason else {}))
    return collate(examples), skipped


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
    sys.exit(int(summary["exit_code"]))


if __name__ == "__main__":
    main()

"""A small deterministic DDP training loop that exercises checkpoint, drain, requeue and resume for real.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 python -m rlslurm.jobs.toytrain --run-dir D --steps 40 &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 python -m rlslurm.jobs.toytrain --run-dir D --steps 40
    kill -USR1 <any rank>      # all ranks drain at the same step, checkpoint, exit 75 (lifecycle.ExitCode)
    RLSLURM_RESTART_COUNT=1 ...  # the same command again resumes from the newest complete checkpoint

Or from submitit: `executor.submit(toytrain.run_job, run_dir, config_path)` (ranks from SUBMITIT_LOCAL_*
or SLURM_*, see rlslurm/dist.py). A tiny MLP fits a fixed synthetic regression set; each rank draws its
batch with torch's RNG and adds numpy noise, so a resume is exact only if model, optimizer, every rank's
RNG states and the data position all come back. Rank 0 writes the per-step loss and, at the end, the
weights' sha256 to metrics.jsonl: an interrupted run must end with the same numbers as one that was not.

It wears the operations kit like every entrance: a PhaseGuard (diag/guard.py) from before the
rendezvous ("start") through "data", "train" and "checkpoint" phases, beating from inside the step, so
the node agent (diag/watchdog.py) sees a wedged rank. A phase's `step` is the step it produces, the
number metrics.jsonl gives that step's loss (1-based). Faults for the operations tests come from the
environment (`Faults`): a rank that stalls, a rank that raises, a job that echoes secrets to its log.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import click
import numpy as np
import psutil
import torch
import torch.distributed as dist
import yaml

from rlslurm import events, lifecycle
from rlslurm.boundary import StepBoundary
from rlslurm.checkpoint import Checkpoint, CheckpointWriter, step_dirname
from rlslurm.config import JobConfig, load_config
from rlslurm.configfile import to_dict
from rlslurm.diag.drain_gate import DrainGate
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, init_process_group
from rlslurm.lifecycle import ExitCode
from rlslurm.rundir import RunDir

SAMPLES, FEATURES, HIDDEN = 256, 8, 32
EXIT_AT_STEP_ENV = "RLSLURM_TEST_EXIT_AT_STEP"
"""Test hook: rank 0 SIGKILLs itself after this step, a node failure that leaves no checkpoint behind."""
STALL_ENV = "RLSLURM_TEST_STALL"
"""Test hook: `RANK@STEP[:sleep|spin]`: that rank stalls in the data phase of STEP while its peers wait in
the step's all_reduce; sleep = in C (time.sleep), spin = a pure-Python loop. First start only (restart
count 0): the requeued start must run through, or a hang test would hang forever."""
SKIP_ENV = "RLSLURM_TEST_SKIP_COLLECTIVE"
"""Test hook: `RANK@STEP`: that rank skips the loss all_reduce of STEP while its peers enter it (a desync: its
next collective meets theirs out of order and every rank hangs). First start only, like STALL_ENV."""
FAIL_ENV = "RLSLURM_TEST_FAIL_AT_STEP"
"""Test hook: rank 0 raises RuntimeError in the train phase of this step, on every start (a failed job)."""
GROW_ENV = "RLSLURM_TEST_GROW"
"""Test hook: `RANK@STEP:MB`: that rank allocates (and touches) MB more memory in the train phase of STEP and
keeps it, as a batch that blows host memory does; under a memory limit the kernel's OOM killer ends it.
First start only, like STALL_ENV."""
ECHO_ENV = "RLSLURM_TEST_ECHO_ENV"
"""Test hook: comma-separated variable names rank 0 prints as NAME=value at start, like a batch script's
`env` or a chatty library: the secrets a diag bundle must redact from the logs."""


_HELD: list[torch.Tensor] = []
"""What GROW_ENV allocated, kept for the rest of the process."""


@dataclasses.dataclass(frozen=True)
class Faults:
    """The faults this rank was asked to inject (from the environment; see the *_ENV hooks above)."""

    stall_step: int | None = None
    stall_mode: str = "sleep"
    skip_step: int | None = None
    fail_step: int | None = None
    grow: tuple[int, int] | None = None
    """(step, MB) of GROW_ENV for this rank."""
    echo: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, rank: int, restarts: int, env=os.environ) -> "Faults":
        stall_step, mode = None, "sleep"
        spec = env.get(STALL_ENV, "")
        if spec and restarts == 0:
            who, _, rest = spec.partition("@")
            step, _, mode = rest.partition(":")
            mode = mode or "sleep"
            if mode not in ("sleep", "spin") or not who.isdigit() or not step.isdigit():
                raise ValueError(f"{STALL_ENV}={spec!r} must look like RANK@STEP[:sleep|spin]")
            stall_step = int(step) if int(who) == rank else None
        skip_step, skip = None, env.get(SKIP_ENV, "")
        if skip and restarts == 0:
            who, _, step = skip.partition("@")
            if not who.isdigit() or not step.isdigit():
                raise ValueError(f"{SKIP_ENV}={skip!r} must look like RANK@STEP")
            skip_step = int(step) if int(who) == rank else None
        grow, spec = None, env.get(GROW_ENV, "")
        if spec and restarts == 0:
            who, _, rest = spec.partition("@")
            step, _, mb = rest.partition(":")
            if not (who.isdigit() and step.isdigit() and mb.isdigit()):
                raise ValueError(f"{GROW_ENV}={spec!r} must look like RANK@STEP:MB")
            grow = (int(step), int(mb)) if int(who) == rank else None
        fail = env.get(FAIL_ENV)
        return cls(stall_step=stall_step, stall_mode=mode, skip_step=skip_step, grow=grow,
                   fail_step=int(fail) if fail and rank == 0 else None,
                   echo=tuple(n for n in env.get(ECHO_ENV, "").split(",") if n) if rank == 0 else ())

    def stall(self, run: RunDir, step: int) -> None:
        if step != self.stall_step:
            return
        events.emit(run, events.FAULT_INJECTED, fault="stall", step=step, mode=self.stall_mode)
        print(f"{STALL_ENV}: stalling in the data phase of step {step} ({self.stall_mode})", flush=True)
        until = time.monotonic() + 3600
        if self.stall_mode == "sleep":
            time.sleep(3600)  # in C: a data loader blocked in a read that never returns
        while time.monotonic() < until:  # spin: busy in Python bytecode, the stack shows this very frame
            pass

    def skips(self, run: RunDir, step: int) -> bool:
        """Whether this rank skips the loss all_reduce of `step`; the event names the sequence number it skips
        (one past the last collective of the default group in this process's flight recorder)."""
        if step != self.skip_step:
            return False
        from torch._C._distributed_c10d import _dump_fr_trace_json

        from rlslurm.diag.collectives import DEFAULT_GROUP, parse

        last = parse("self", json.loads(_dump_fr_trace_json(True, False))).last(DEFAULT_GROUP)
        seq = last.seq + 1 if last is not None else None
        events.emit(run, events.FAULT_INJECTED, fault="skip_collective", step=step, mode="all_reduce",
                    op="all_reduce", seq=seq)
        print(f"{SKIP_ENV}: skipping the loss all_reduce #{seq} of step {step}", flush=True)
        return True

    def swell(self, run: RunDir, step: int) -> None:
        if self.grow is None or step != self.grow[0]:
            return
        events.emit(run, events.FAULT_INJECTED, fault="grow", step=step, mode=f"{self.grow[1]} MB")
        print(f"{GROW_ENV}: allocating {self.grow[1]} MB in the train phase of step {step}", flush=True)
        # torch.ones writes every page: an untouched allocation would never be charged to the cgroup.
        _HELD.append(torch.ones(self.grow[1] * 2**18, dtype=torch.float32))

    def fail(self, step: int) -> None:
        if step == self.fail_step:
            raise RuntimeError(f"toy fault: rank 0 raises in the train phase of step {step} ({FAIL_ENV})")


def _dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return x, x @ w + 0.3 * torch.sin(3 * x[:, :1])


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class ToyTrainer:
    """Model, optimizer, data and the collective save/load of one rank."""

    def __init__(self, run: RunDir, cfg: JobConfig, topo: Topology):
        self.run, self.cfg, self.topo = run, cfg, topo
        torch.manual_seed(cfg.train.seed)  # identical init on every rank
        self.module = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=cfg.train.lr)
        self.model = torch.nn.parallel.DistributedDataParallel(self.module)
        self.x, self.y = _dataset(cfg.train.seed)
        self.per_rank = max(1, cfg.train.batch_size // topo.world_size)
        # Per-rank streams so ranks draw different batches; restored from the checkpoint on resume.
        rank_seed = cfg.train.seed * 1000 + topo.rank + 1
        torch.manual_seed(rank_seed)
        np.random.seed(rank_seed)
        random.seed(rank_seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, targets): draws from the rank's torch and numpy streams."""
        idx = torch.randint(0, SAMPLES, (self.per_rank,))
        noise = torch.from_numpy(np.random.normal(0.0, 0.01, size=(self.per_rank, 1)).astype(np.float32))
        return self.x[idx], self.y[idx] + noise

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], beat=lambda: None, skip_reduce=lambda: False) -> float:
        """One optimizer step (DDP all-reduces the gradients inside backward); the loss averaged over ranks
        (where `skip_reduce()` says so: this rank's own loss, its peers left in the all_reduce: the desync hook)."""
        loss = torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])
        self.optimizer.zero_grad()
        loss.backward()
        beat()
        self.optimizer.step()
        mean = loss.detach().clone()
        if skip_reduce():
            mean *= self.topo.world_size
        else:
            dist.all_reduce(mean)
        beat()
        return mean.item() / self.topo.world_size

    def save(self, step: int) -> float:
        """Collective: gather every rank's RNG, rank 0 writes; returns the save's seconds on every rank."""
        rngs = [None] * self.topo.world_size
        dist.all_gather_object(rngs, _rng_state())
        seconds = [0.0]
        if self.topo.is_main:
            with CheckpointWriter(self.run, step, keep=self.cfg.checkpoint.keep,
                                  metadata={"world_size": self.topo.world_size, "job": "toytrain"}) as ckpt:
                ckpt.save_tensors("model", self.module.state_dict())
                ckpt.save_state("optimizer", self.optimizer.state_dict())
                ckpt.save_state("rng", rngs)
                ckpt.save_json("trainer", {"step": step, "data_position": step * self.per_rank * self.topo.world_size,
                                           "seed": self.cfg.train.seed})
            seconds = [ckpt.saved.seconds]
        dist.broadcast_object_list(seconds, src=0)
        return seconds[0]

    def load(self, ckpt: Checkpoint) -> int:
        self.module.load_state_dict(ckpt.load_tensors("model"))
        self.optimizer.load_state_dict(ckpt.load_state("optimizer"))
        rngs = ckpt.load_state("rng")
        if len(rngs) != self.topo.world_size:
            raise RuntimeError(f"{ckpt.path} holds RNG of {len(rngs)} ranks, this run has {self.topo.world_size}")
        _set_rng_state(rngs[self.topo.rank])
        return int(ckpt.load_json("trainer")["step"])


def train(run_dir: str | Path, cfg: JobConfig, *, step_delay_s: float = 0.0, time_limit_s: float | None = None,
          requeue=lifecycle.requeue_job) -> ExitCode:
    """Run (or resume) the toy job in this process as one rank; returns the lifecycle exit code."""
    run = RunDir(Path(run_dir)).create()
    topo = Topology.detect()
    os.environ.setdefault("RLSLURM_RANK", str(topo.rank))
    torch.set_num_threads(1)
    gate = DrainGate(run, poll_interval_s=0.5, kill_wait_s=cfg.checkpoint.kill_wait_s)
    gate.install_signal_handlers()
    try:
        # Guarded from before the rendezvous: a rank that never joins shows up stuck in phase "start".
        with PhaseGuard(run, "train", topo.rank, cfg.diag, gate=gate, job_id=lifecycle.leader_job_id()) as guard:
            # The toy model computes on the CPU wherever it runs; its collectives wait train.dist_timeout_s.
            init_process_group(topo, timeout_s=cfg.train.dist_timeout_s, backend="gloo")
            try:
                code = _train(run, cfg, topo, gate, guard, step_delay_s, time_limit_s, requeue)
                # Leave together: a rank tearing gloo down while its peer still talks to the store (hosted
                # by rank 0) aborted with "terminate called without an active exception".
                dist.barrier()
            finally:
                dist.destroy_process_group()
        return code
    finally:
        gate.restore_signal_handlers()


def _train(run, cfg, topo, gate, guard, step_delay_s, time_limit_s, requeue) -> ExitCode:
    if topo.is_main and not run.config.exists():
        run.config.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    restarts = lifecycle.restart_count()
    faults = Faults.from_env(topo.rank, restarts)
    for name in faults.echo:
        print(f"{name}={os.environ.get(name, '')}", flush=True)
    trainer = ToyTrainer(run, cfg, topo)
    path, proceed = lifecycle.agree_on_start(run, is_main=topo.is_main, restarts=restarts,
                                             max_no_progress_restarts=cfg.checkpoint.max_no_progress_restarts)
    if not proceed:
        return ExitCode.NO_PROGRESS
    step = trainer.load(Checkpoint.open(Path(path), verify=False)) if path else 0
    last_saved = step if path else None
    boundary = StepBoundary(run, topo, gate, cfg, start_step=step, time_limit_s=time_limit_s, requeue=requeue)
    policy = boundary.interval
    pause, exit_at = threading.Event(), int(os.environ.get(EXIT_AT_STEP_ENV, "-1"))
    first_step = True

    def save(at: int) -> str:
        nonlocal last_saved
        if last_saved != at:
            with guard.phase("checkpoint", step=at):
                policy.observe_save(at, trainer.save(at))
            last_saved = at
        return step_dirname(at)

    while True:
        # Step boundary (rlslurm/boundary.py): every rank agrees to drain / save at the same step.
        at = boundary.agree(step)
        if at.drain:
            return boundary.drain(step, at, lambda step=step: save(step))
        if at.checkpoint_due:
            save(step)
        if step >= cfg.train.steps:
            break
        started = time.monotonic()
        with guard.phase("data", step=step + 1):
            batch = trainer.batch()
            faults.stall(run, step + 1)
        with guard.phase("train", step=step + 1):
            faults.fail(step + 1)
            faults.swell(run, step + 1)
            loss = trainer.step(batch, beat=guard.beat,
                                skip_reduce=lambda next_step=step + 1: faults.skips(run, next_step))
        step += 1
        policy.observe_step(time.monotonic() - started)
        if topo.is_main:
            run.append_json(run.metrics, {"t": time.time(), "step": step, "loss": loss, "restart_count": restarts})
            if first_step:
                since = time.time() - psutil.Process().create_time()
                events.emit(run, events.FIRST_STEP, step=step, since_process_start_s=round(since, 3))
        first_step = False
        if step == exit_at and topo.is_main:
            os.kill(os.getpid(), signal.SIGKILL)
        if step_delay_s:
            with guard.phase("train", step=step):
                pause.wait(step_delay_s)  # stands in for real compute, so tests can signal mid-run
    save(step)
    if topo.is_main:
        digest = weights_sha256(trainer.module)
        run.append_json(run.metrics, {"t": time.time(), "final": True, "step": step, "weights_sha256": digest})
        events.emit(run, events.DONE, step=step, weights_sha256=digest)
    return ExitCode.DONE


def run_job(run_dir: str, config_path: str | None = None, **overrides) -> int:
    """Function form for submitit: load the YAML, apply `train.*` / `checkpoint.*` overrides, train."""
    cfg = load_config(config_path) if config_path else JobConfig()
    train_over = {k[6:]: v for k, v in overrides.items() if k.startswith("train_")}
    ckpt_over = {k[11:]: v for k, v in overrides.items() if k.startswith("checkpoint_")}
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train_over),
                              checkpoint=dataclasses.replace(cfg.checkpoint, **ckpt_over))
    return int(train(run_dir, cfg, step_delay_s=overrides.get("step_delay_s", 0.0),
                     time_limit_s=overrides.get("time_limit_s")))


@click.command()
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="The run directory.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), help="Job YAML.")
@click.option("--steps", type=int, help="train.steps override.")
@click.option("--lr", type=float, help="train.lr override.")
@click.option("--seed", type=int, help="train.seed override.")
@click.option("--interval-steps", type=int, help="checkpoint.interval_steps override.")
@click.option("--step-delay-s", type=float, default=0.0, help="Seconds of idle per step (tests signal mid-run).")
@click.option("--time-limit-s", type=float, help="Allocation time limit for the checkpoint cap.")
def main(run_dir, config_path, steps, lr, seed, interval_steps, step_delay_s, time_limit_s):
    over = {f"train_{k}": v for k, v in (("steps", steps), ("lr", lr), ("seed", seed)) if v is not None}
    if interval_steps is not None:
        over["checkpoint_interval_steps"] = interval_steps
    sys.exit(run_job(run_dir, config_path, step_delay_s=step_delay_s, time_limit_s=time_limit_s, **over))


if __name__ == "__main__":
    main()

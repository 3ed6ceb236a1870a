"""The RL step loop on every trainer rank; rank 0 also drives the controller.

    code = run(job, run_dir)        # jobs/rl.py's entrance; returns the lifecycle exit code

One step reads like the diagram at the top of README.md, each phase inside the phase guard:

    boundary (drain? checkpoint due?) -> experience (prompts -> rollout -> reward -> advantages, rank 0,
    shared with every rank) -> train (every rank, its share) -> sync (DRAIN/UPDATE/VERIFY/RESUME) ->
    metrics (+ held-out evaluation) -> next boundary

Drain (USR1, `rlslurm drain`, SIGTERM): the ranks agree at a step boundary (rlslurm/boundary.py), the
controller drains the engines, rank 0 checkpoints and requeues the whole het job; the next start
resumes at that step and policy version and syncs its new engines to it. Engine sampling is seeded by
(train.seed, step, engine), so a resumed run draws the same samples as the uninterrupted one.

A step SLURM interrupts (its SIGTERM reaches the engines and the reward service too) is given up, not
trained on what the stopping services returned: the drain checkpoint is taken before it, and the
resumed job makes it again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from rlslurm import events, lifecycle, plan_vs_run
from rlslurm.boundary import StepBoundary
from rlslurm.config import JobConfig
from rlslurm.diag.drain_gate import DrainGate
from rlslurm.diag.env_diff import write_fingerprint
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, init_process_group, release_process_group_users
from rlslurm.errors import CheckpointError, RlslurmError
from rlslurm.lifecycle import ExitCode
from rlslurm.lifetime import process_age_s
from rlslurm.memory_meter import process_rss_peak_gb, step_memory
from rlslurm.metrics_sinks import MetricsLog
from rlslurm.rl.checkpointing import CheckpointSaves, resume_point
from rlslurm.rl.controller import Controller
from rlslurm.rl.experience import Experience
from rlslurm.rl.policy import Policy, RLPolicy
from rlslurm.rundir import RunDir
from rlslurm.sync.protocol import SyncReport
from rlslurm.tinymodel import build_model, save_hf

log = logging.getLogger(__name__)


def run(job: JobConfig, run_dir: str | Path) -> int:
    """One trainer rank of the RL job (rank 0 also drives the controller); returns the lifecycle code."""
    run_ = RunDir(Path(run_dir)).create()
    topo = Topology.detect()
    torch.set_num_threads(1)
    init_process_group(topo, job.train.dist_timeout_s)
    gate = DrainGate(run_, poll_interval_s=0.5, kill_wait_s=job.checkpoint.kill_wait_s)
    gate.install_signal_handlers()
    guard = PhaseGuard(run_, "train", topo.rank, job.diag, gate=gate)
    write_fingerprint(run_, "train", topo.rank)
    controller = None
    metrics = MetricsLog(run_, job.logging)  # rank 0 appends: metrics.jsonl, then TensorBoard / W&B if on
    try:
        with guard:
            model_dir = initial_model_dir(job, run_, topo)
            policy = make_policy(job, topo, model_dir)
            controller = Controller(job, run_, model_dir, policy.tokenizer, stopping=lambda: gate.requested) \
                if topo.is_main else None
            try:
                code = Loop(job, run_, topo, gate, guard, policy, controller, metrics).run()
            except Exception as e:
                # The step loop gives up a step only when SLURM stops the job; anything else that left it
                # fails the job. Where an engine is behind it, say which (node, pid, exit code, log).
                if controller is not None:
                    controller.engines.failed(e)
                raise
            # Leave together (done or drained): a rank tearing gloo down while a peer still talks to
            # the store that rank 0 hosts aborted with "terminate called without an active exception".
            dist.barrier()
            del policy
            release_process_group_users()
            return code
    finally:
        if controller is not None:
            controller.close()
        metrics.close()
        gate.restore_signal_handlers()
        dist.destroy_process_group()


def make_policy(job: JobConfig, topo: Topology, model_dir: Path) -> RLPolicy:
    """train.backend: torch = rlslurm/rl/policy.py Policy (DDP); megatron = rlslurm/megatron/policy.py (same interface;
    Megatron's DDP and distributed optimizer, on the GPU under NCCL or the CPU over gloo)."""
    if job.train.backend == "megatron":
        from rlslurm.megatron.policy import MegatronPolicy

        return MegatronPolicy(job, topo, model_dir)
    return Policy(job, topo, model_dir)


def initial_model_dir(job: JobConfig, run: RunDir, topo: Topology) -> Path:
    """train.init_from as it is (the SFT export), or the embedded model at random init written once."""
    if job.train.init_from:
        path = Path(job.train.init_from)
        if not (path / "config.json").is_file():
            raise RlslurmError(f"train.init_from = {job.train.init_from!r} holds no config.json: point it at an "
                               "SFT export (<sft run>/export/hf)")
        return path
    path = run.path / "export" / "init"
    if topo.is_main and not (path / "config.json").is_file():
        save_hf(build_model(job.model, seed=job.train.seed), path, max_new_tokens=job.rollout.max_new_tokens)
    dist.barrier()
    return path


@dataclass
class Loop:
    """The RL job's loop state on one rank; `run()` is the loop."""

    job: JobConfig
    run_dir: RunDir
    topo: Topology
    gate: DrainGate
    guard: PhaseGuard
    policy: RLPolicy
    controller: Controller | None
    """Rank 0's controller; None on the other ranks."""
    metrics: MetricsLog
    """Rank 0's per-step metrics: metrics.jsonl and the sinks of `logging:`."""
    step: int = 0
    version: int = 0
    rl_state: dict = field(default_factory=dict)
    last_saved: int | None = None
    memory_ranks: list | None = None
    """Every rank's memory peaks of the step just trained, on rank 0 when it was metered (else None)."""
    saves: CheckpointSaves | None = None
    """The periodic saves, retried and counted (rlslurm/rl/checkpointing.py): a storage fault is survived."""

    def run(self) -> int:
        job, run = self.job, self.run_dir
        self.saves = CheckpointSaves(run, job, self.topo)
        self.step, self.version, self.rl_state, proceed = resume_point(job, run, self.topo, self.policy)
        if not proceed:
            return ExitCode.NO_PROGRESS
        boundary = StepBoundary(run, self.topo, self.gate, job, start_step=self.step)
        interval = boundary.interval
        self._first_sync()
        self.last_saved = self.step if self.step else None
        first_step = True
        while True:
            at = boundary.agree(self.step)           # every rank: drain? checkpoint due? (rlslurm/boundary.py)
            if at.drain:
                return boundary.drain(self.step, at, self._save_for_drain, before=self._drain_engines)
            if at.checkpoint_due and self.last_saved != self.step:
                with self.guard.phase("checkpoint", step=self.step):
                    seconds = self._save()
                if seconds is None:  # skipped after its tries: training goes on, the next try an interval on
                    interval.observe_failed_save(self.step)
                else:
                    interval.observe_save(self.step, seconds)
            if self.step >= job.train.steps:
                break
            started = time.monotonic()
            if self.policy.meter.start_step(self.step + 1):  # a metered step: the engines' peaks start here too
                self._engine_peaks(reset=True)
            exp = self._experience()                 # prompts -> rollout -> reward -> advantages
            if exp is None:
                continue  # abandoned: every rank drains at this step's boundary (rank 0's flag reaches them)
            stats, train_s = self._train(exp)        # train
            self.step += 1
            self.version += 1
            if self.controller is not None:
                sync_metrics, sync_s = self._sync()  # sync
                self._record(exp, stats, train_s, sync_metrics, sync_s, started, first_step)
            first_step = False
            if job.train.step_delay_s:
                with self.guard.phase("train", step=self.step):
                    threading.Event().wait(job.train.step_delay_s)  # stands in for compute: tests signal mid-run
            interval.observe_step(time.monotonic() - started)
        self._finish()
        return ExitCode.DONE

    # -- the phases ------------------------------------------------------------------------------------

    def _first_sync(self) -> None:
        """Rank 0: env check, then the engines (started from the initial weights) serve exactly this rank's
        (resumed) policy; the first held-out evaluation; the experience pipeline from here on."""
        controller = self.controller
        if controller is None:
            return
        # a lone engine's replacement is synced to them mid-step (all it serves: with train.lora, the base too)
        controller.current_weights = lambda: self.policy.served_weights(full=True)
        with self.guard.phase("data", step=self.step):  # first: a checkpoint of other data fails the start here
            controller.stream.resume(self.step, self.rl_state.get("data"))
        with self.guard.phase("sync", step=self.step):
            controller.check_env()
            controller.sync_engines(self.policy.served_weights(full=True), version=self.version, step=self.step)
        if "eval_history" not in self.rl_state:
            result = controller.evaluate(self.step)
            self.rl_state["eval_history"] = [[self.step, result["held_out_accuracy"]]]
            self.rl_state["last_eval"] = result
            events.emit(self.run_dir, events.EVAL, step=self.step, **result)
        # rl.max_staleness > 0: from here on the next steps' rollouts run while this one trains.
        controller.start_experience(self.step, self.version, self.rl_state)

    def _experience(self) -> Experience | None:
        """This step's experience, made on rank 0 (possibly ahead, rl.max_staleness) and shared with every
        rank; None when the step was abandoned because SLURM stops the job."""
        box: list[Experience | None] = [None]
        controller, step = self.controller, self.step
        if controller is not None:
            try:
                box = [controller.experience(step, self.version, self.guard)]
            except RlslurmError as e:
                if not _stopped_by_slurm(self.gate):
                    raise
                events.emit(self.run_dir, events.STEP_ABANDONED, step=step,
                            reason=f"SLURM stops the job and its engines: {e}")
            degraded = _degraded_by_slurm_stop(box[0], self.gate)
            if degraded:
                events.emit(self.run_dir, events.STEP_ABANDONED, step=step,
                            reason=f"SLURM stops the job and its reward service: {degraded} responses degraded")
                box = [None]
            if box[0] is None:  # the resumed job makes it again, not from the checkpoint's buffer
                controller.forget_experience(step, self.rl_state)
        with self.guard.phase("wait_experience", step=step):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _train(self, exp: Experience) -> tuple[dict, float]:
        """This rank's share of the samples through one policy update; (stats, seconds). On a metered step
        (rlslurm/memory_meter.py) rank 0 gathers every rank's memory peaks into `memory_ranks`."""
        t = time.monotonic()
        meter = self.policy.meter
        metered = meter.metered
        with self.guard.phase("train", step=self.step):
            share = exp.samples[self.topo.rank::self.topo.world_size]
            stats = self.policy.update(share, self.guard, step_total=len(exp.samples))
        seconds = time.monotonic() - t
        self.memory_ranks = None
        if metered:  # every rank meters the same steps (by step number), so every rank joins this gather
            ranks: list = [None] * self.topo.world_size
            dist.all_gather_object(ranks, meter.peaks())
            self.memory_ranks = ranks
        return stats, seconds

    def _sync(self) -> tuple[dict, float]:
        """Rank 0: the new weights to the engines (verified); (metrics, seconds)."""
        t = time.monotonic()
        with self.guard.phase("sync", step=self.step), self.policy.meter.measure("sync"):
            try:
                metrics = self.controller.sync_weights(self.policy.served_weights(), step=self.step,
                                                       version=self.version, guard=self.guard)
                if self.job.rl.max_staleness:  # a checkpoint at this boundary keeps the steps made ahead
                    self.rl_state["experience_buffer"] = self.controller.experience_buffer(self.step, self.guard)
                metrics = {**metrics, "sync_skipped": False}
            except RlslurmError as e:
                if not _stopped_by_slurm(self.gate):
                    raise
                # The trained step stands: the drain checkpoint holds it, and the resumed job's first
                # sync puts these weights into its new engines.
                events.emit(self.run_dir, events.SYNC_SKIPPED, step=self.step,
                            reason=f"SLURM stops the job and its engines: {e}")
                metrics = skipped_sync_metrics()
        return metrics, time.monotonic() - t

    def _record(self, exp: Experience, stats: dict, train_s: float, sync_metrics: dict, sync_s: float,
                started: float, first_step: bool) -> None:
        """Rank 0: the step's line of metrics.jsonl (with a held-out evaluation when due)."""
        job, step = self.job, self.step
        record = step_record(exp, stats, train_s, sync_metrics, sync_s, step_s=time.monotonic() - started,
                             step=step, version=self.version)
        if self.memory_ranks is not None:  # rank 0's own figures now include its sync phase
            self.memory_ranks[0] = self.policy.meter.peaks()
        record.update(step_memory(self.memory_ranks))
        if self.memory_ranks is not None:
            record["engine_rss_peak_gb"] = self._engine_peaks(reset=False)
        if (step % job.rl.eval_every == 0 or step == job.train.steps) and not sync_metrics["sync_skipped"]:
            result = self.controller.evaluate(step)
            record.update(result)
            self.rl_state.setdefault("eval_history", []).append([step, result["held_out_accuracy"]])
            self.rl_state["last_eval"] = result
        self.metrics.append(record)
        if step == min(plan_vs_run.CHECK_STEP, job.train.steps):  # the run meets its plan, once
            plan_vs_run.check(self.run_dir, step)
        if first_step:  # requeue -> training again is measured up to here
            since = process_age_s()
            events.emit(self.run_dir, events.FIRST_STEP, step=step, policy_version=self.version,
                        since_process_start_s=round(since, 3), device=str(self.policy.device))
        log.info("step %d v%d reward %.3f eff %d/%d rollout %.2fs train %.2fs sync %.2fs%s", step, self.version,
                 exp.stats["reward_mean"], exp.stats["effective_samples"], exp.stats["samples"],
                 exp.stats["rollout_s"], train_s, sync_s,
                 f" acc {record['held_out_accuracy']:.3f}" if "held_out_accuracy" in record else "")

    def _engine_peaks(self, reset: bool) -> float | None:
        """Rank 0: the largest resident-set peak of the engines it spawned beside itself (colocated ones share this
        node's memory), since the last reset; None where it spawned none."""
        if self.controller is None:
            return None
        peaks = [process_rss_peak_gb(sup.pid, reset=reset) for sup in self.controller.engines.supervisors
                 if sup.pid is not None]
        peaks = [p for p in peaks if p is not None]
        return max(peaks) if peaks else None

    def _save(self) -> float | None:
        """Collective: a checkpoint at this step boundary; its cost in seconds, None when every try failed."""
        if self.controller is not None:  # the next row step `step` draws: a resume goes on there
            self.rl_state["data"] = self.controller.data_state(self.step)
        seconds = self.saves.save(self.policy, self.step, self.version, self.rl_state)
        if seconds is not None:
            self.last_saved = self.step
        return seconds

    def _drain_engines(self, signal_name: str | None) -> None:
        """Rank 0, at the step the ranks agreed to drain at: the engines stop taking prompts and finish what is
        in flight (then the trainer checkpoints and the leader requeues the whole het job)."""
        if self.controller is None:
            return
        if signal_name == "SIGTERM":
            # SLURM sent SIGTERM to every step, the engines' too: they are stopping already, and KillWait is for
            # the checkpoint.
            events.emit(self.run_dir, events.ENGINES_DRAINED, role="controller", engines={},
                        reason="stopped by SLURM (SIGTERM)")
        else:
            self.controller.engines.drain(self.job.sync.timeout_s)

    def _save_for_drain(self) -> str | None:
        """Collective: the drain checkpoint of this step (unless the periodic one holds it already); None when
        every try failed (drained without it: the resume takes the newest complete one)."""
        if self.last_saved != self.step and self._save() is None:
            return None
        return f"step-{self.step:08d}"

    def _finish(self) -> None:
        """All steps ran: the final checkpoint, and rank 0's HF export of the trained policy."""
        if self.last_saved != self.step and self._save() is None:
            raise CheckpointError(f"the final checkpoint (step {self.step}) could not be written: see the "
                                  f"checkpoint_failed events; `rlslurm resume` goes on from the newest complete one")
        if self.topo.is_main:
            save_hf(self.policy.model, self.run_dir.path / "export" / "hf",
                    max_new_tokens=self.job.rollout.max_new_tokens, tokenizer=self.policy.tokenizer)
            events.emit(self.run_dir, events.DONE, step=self.step, policy_version=self.version,
                        held_out_accuracy=self.rl_state.get("eval_history", [[0, None]])[-1][1],
                        **{k: v for k, v in self.rl_state.get("last_eval", {}).items()
                           if k in ("eval_reward_mean", "eval_pass_rate")})


EVAL_KEYS = ("held_out_accuracy", "eval_reward_mean", "eval_pass_rate", "eval_rows")
"""What a held-out evaluation (Controller.evaluate) adds to its step's metrics row (every rl.eval_every steps and
the last); every other key is in every row of the run (docs/metrics.md)."""


def step_record(exp: Experience, stats: dict, train_s: float, sync_metrics: dict, sync_s: float, *,
                step_s: float, step: int, version: int) -> dict:
    """One line of metrics.jsonl: the step's seconds and shares per phase, its samples/s, and the stats
    of experience, update and sync."""
    record = {"t": time.time(), "step": step, "policy_version": version,
              "restart_count": lifecycle.restart_count(), **exp.stats,
              "train_s": train_s, "sync_s": sync_s, **stats, **sync_metrics}
    total = exp.stats["rollout_s"] + exp.stats["reward_s"] + train_s + sync_s
    record["step_s"] = step_s
    for phase in ("rollout", "reward", "train", "sync"):
        record[f"{phase}_share"] = record[f"{phase}_s"] / total if total else 0.0
    record["effective_samples_per_s"] = exp.stats["effective_samples"] / step_s
    return record


def skipped_sync_metrics() -> dict:
    """A sync SLURM's stop left to the next start: a synced step's keys (docs/metrics.md), each stage 0 (the
    row's `sync_s` stays the seconds the failed attempt took), and `sync_skipped: true`."""
    zero = {k: v for k, v in SyncReport(transport="", version=-1).metrics().items() if k != "sync_s"}
    return {**zero, "sync_wait_rollout_s": 0.0, "sync_skipped": True}


def _stopped_by_slurm(gate: DrainGate, grace_s: float = 2.0) -> bool:
    """Whether an engine call just failed because SLURM stops the whole job (requeue, preemption,
    cancel): then our own SIGTERM comes too, within grace_s, since each node's slurmstepd signals its
    tasks on its own clock. The step in flight is given up and the drain at the boundary checkpoints."""
    deadline = time.monotonic() + grace_s
    while gate.signal_name != "SIGTERM" and time.monotonic() < deadline:
        time.sleep(0.05)  # the handler runs in this (main) thread, between two sleeps
    return gate.signal_name == "SIGTERM"


def _degraded_by_slurm_stop(exp: Experience | None, gate: DrainGate, grace_s: float = 0.5) -> int:
    """Responses of `exp` degraded because SLURM stops the job (0 when none, or no SIGTERM came): its
    SIGTERM reached the reward component too, whose service went away mid-step. Trained, they would put
    neutral rewards into the drain checkpoint; the step is given up and the resumed job makes it again."""
    degraded = exp.stats.get("reward_degraded", 0) if exp is not None else 0
    return degraded if degraded and _stopped_by_slurm(gate, grace_s) else 0

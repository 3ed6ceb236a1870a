"""How a job starts, leaves and comes back: the exit-code contract of the requeue loop.

Exit codes of a job process (`ExitCode`), and what the batch script / launcher does with each:

    0  DONE           all steps ran; final checkpoint written            -> nothing
    1  FAILED         an error; the log and events say which             -> nothing (a human looks)
    75 DRAINED        drained: in-flight step finished, checkpointed,    -> nothing: it already asked
                      and (on SLURM) `scontrol requeue` of itself sent      SLURM to requeue it
    76 HANG_DETECTED  the watchdog found a hang and dumped stacks        -> requeue (`needs_requeue`)
    77 NO_PROGRESS    N starts in a row resumed from the same step:      -> nothing: stop the storm
                      it gave up requeueing itself

75 is sysexits' EX_TEMPFAIL ("try again later"); 76/77 follow it, clear of the CLI's error codes (1-10,
rlslurm/errors.py) and of the 128+N of a death by signal.

Start: `on_start(run, restart_count, step=..., checkpoint=...)` (rank 0, after picking the checkpoint)
records the start in jobs.jsonl and emits `resume` or `start`; the requeue-storm guard compares the
step this start resumes from with the previous starts': work that is not in a checkpoint is lost on a
restart, so a start that resumes from the same step as the one before it made no progress.

Drain: after the in-flight step, `finish_drain(...)` checkpoints, requeues the job through its leader
job id (USR1 / control file only: after a SIGTERM, SLURM is already requeueing, preempting or cancelling
us, and a second requeue would fail), and returns DRAINED. On SIGTERM the checkpoint is written only if
the measured cost C (x margin) fits in what is left of KillWait; otherwise the periodic one is relied on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Mapping

from rlslurm import events
from rlslurm.errors import SlurmCommandError
from rlslurm.node import node_name
from rlslurm.rundir import RunDir, read_jsonl


class ExitCode(IntEnum):
    """Exit status of a job process; the requeue loop reads it (see the module docstring)."""

    DONE = 0
    FAILED = 1
    DRAINED = 75
    HANG_DETECTED = 76
    NO_PROGRESS = 77


def needs_requeue(code: int) -> bool:
    """Whether the launcher must requeue after this exit (DRAINED requeued itself already)."""
    return code == ExitCode.HANG_DETECTED


NOT_UNDER_SLURM = "not under SLURM: not requeued; `rlslurm resume <run dir>` (or its launcher) starts it again"
"""What a drained event says off SLURM, where nothing requeues the job."""
SLURM_SIGTERM = ("not by this job: SLURM sent SIGTERM (a requeue or preemption brings the job back by itself; "
                 "a scancel or time limit ends it: then `rlslurm resume <run dir>`)")
"""What a drained event says after SLURM's SIGTERM: whether SLURM requeues the job is SLURM's to say (its
state: PENDING after a requeue); no event claims a requeue this job did not make (issue 28, case 2)."""


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times this job was restarted: RLSLURM_RESTART_COUNT (local launcher) or SLURM_RESTART_COUNT."""
    e = os.environ if env is None else env
    return int(e.get("RLSLURM_RESTART_COUNT") or e.get("SLURM_RESTART_COUNT") or 0)


def leader_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The job id to requeue: a het job only requeues through its leader (component 0); None off SLURM.

    SLURM 22.05 never sets SLURM_HET_JOB_ID, so our batch script exports RLSLURM_LEADER_JOB_ID; the
    per-component SLURM_JOB_ID_HET_GROUP_0 is the fallback inside the batch shell.
    """
    e = os.environ if env is None else env
    for key in ("RLSLURM_LEADER_JOB_ID", "SLURM_HET_JOB_ID", "SLURM_JOB_ID_HET_GROUP_0", "SLURM_JOB_ID"):
        if e.get(key):
            return e[key]
    return None


def requeue_job(job_id: str) -> str:
    """`scontrol requeue <job_id>` through the one SLURM seam; what happened (commands.requeue)."""
    from rlslurm.slurm import commands  # only jobs on SLURM get here

    return commands.requeue(job_id)


@dataclass(frozen=True)
class StartDecision:
    """What `on_start` found: go on, or stop with NO_PROGRESS."""

    proceed: bool
    fruitless_starts: int
    code: ExitCode | None = None


def on_start(run: RunDir, restart_count: int, *, step: int, checkpoint: str | None,
             max_no_progress_restarts: int, env: Mapping[str, str] | None = None) -> StartDecision:
    """Record this start; emit `resume` / `start`, or `no_progress` and tell the caller to stop."""
    e = os.environ if env is None else env
    trainer_restart = int(e.get("RLSLURM_TRAINER_RESTART") or 0)
    # The storm guard counts starts across requeues only: a restart of the trainer ranks inside the allocation
    # (rlslurm/slurm/supervisor.py) has its own budget, train.max_restarts, and counting it here too would end
    # the job NO_PROGRESS before that budget is spent and the failed node avoided. Bounded either way: at most
    # (train.max_restarts + 1) x checkpoint.max_no_progress_restarts starts without progress.
    previous = [r for r in read_jsonl(run.jobs) if not r.get("trainer_restart")]
    fruitless = 0
    for record in reversed(previous):
        if record.get("step") != step:
            break
        fruitless += 1
    run.record_start(job_id=leader_job_id(e), restart_count=restart_count, host=node_name(),
                     pid=os.getpid(), step=step, checkpoint=checkpoint,
                     **({"trainer_restart": trainer_restart} if trainer_restart else {}))
    extra = {"trainer_restart": trainer_restart} if trainer_restart else {}
    if trainer_restart:
        fruitless = 0  # this allocation's first start passed the guard; train.max_restarts bounds the rest
    if fruitless >= max_no_progress_restarts:
        events.emit(run, events.NO_PROGRESS, step=step, checkpoint=checkpoint, restart_count=restart_count,
                    fruitless_starts=fruitless,
                    reason=f"{fruitless} starts in a row resumed from step {step} (checkpoint {checkpoint}) "
                           f"without a newer checkpoint; checkpoint.max_no_progress_restarts = "
                           f"{max_no_progress_restarts}: not requeueing again")
        return StartDecision(False, fruitless, ExitCode.NO_PROGRESS)
    if checkpoint is None:
        events.emit(run, events.START, step=step, restart_count=restart_count, **extra)
    else:
        events.emit(run, events.RESUME, step=step, checkpoint=checkpoint, restart_count=restart_count, **extra)
    return StartDecision(True, fruitless)


_LOST_STATES = ("DOWN", "NOT_RESPONDING", "FAIL", "DRAIN", "NO_RESPOND")


def name_lost_nodes(run: RunDir, restart_count: int,
                    show_node: Callable[[str], list[dict]] | None = None) -> list[dict]:
    """On a restart: the nodes the previous attempt ran on (placement.jsonl) that SLURM now holds DOWN, not
    responding or drained, each as a `node_lost` event (node, SLURM's state and reason). SLURM requeued the
    job off them (a lost node is NODE_FAIL); this says which node it was, for `rlslurm diag` and people."""
    if restart_count <= 0:
        return []
    if show_node is None:
        from rlslurm.slurm.commands import show_node
    before = {p["node"] for p in read_jsonl(run.path / "placement.jsonl")
              if p.get("restart_count") == restart_count - 1 and p.get("node")}
    # rlslurm/slurm/rejoin.py names the nodes it kept the job off before this start: not twice
    said = {e.get("node") for e in events.read_events(run, events.NODE_LOST) if e.get("restart_count") == restart_count}
    lost = lost_nodes(before - said, restart_count, show_node)
    for record in lost:
        events.emit(run, events.NODE_LOST, **record)
    return lost


def lost_nodes(nodes, restart_count: int, show_node: Callable[[str], list[dict]]) -> list[dict]:
    """Which of `nodes` SLURM holds DOWN, not responding or drained: {node, state, reason, restart_count}."""
    lost = []
    for node in sorted(nodes):
        try:
            record = (show_node(node) or [{}])[0]
        except SlurmCommandError as e:  # a node SLURM no longer knows is lost too; say why
            record = {"State": "UNKNOWN", "Reason": str(e)}
        state = record.get("State", "")
        if any(s in state for s in _LOST_STATES):
            lost.append({"node": node, "state": state, "reason": record.get("Reason") or "none given",
                         "restart_count": restart_count})
    return lost


def agree_on_start(run: RunDir, *, is_main: bool, max_no_progress_restarts: int,
                   restarts: int | None = None) -> tuple[str | None, bool]:
    """Collective, at every start of a job with a torch.distributed world: rank 0 picks the newest
    complete checkpoint and runs `on_start`; every rank learns (checkpoint path or None, proceed)."""
    import torch.distributed as dist

    from rlslurm.checkpoint import latest_complete  # lazily: checkpoint imports torch

    box: list = [None, True]
    if is_main:
        ckpt = latest_complete(run)
        decision = on_start(run, restart_count() if restarts is None else restarts,
                            step=ckpt.step if ckpt else 0, checkpoint=ckpt.name if ckpt else None,
                            max_no_progress_restarts=max_no_progress_restarts)
        box = [str(ckpt.path) if ckpt else None, decision.proceed]
    dist.broadcast_object_list(box, src=0)
    return box[0], box[1]


def finish_drain(run: RunDir, *, step: int, reason: str | None, signal_name: str | None,
                 save: Callable[[], str | None], cost_s: float, time_left_s: float | None, is_leader: bool,
                 requeue: Callable[[str], object] = requeue_job, env: Mapping[str, str] | None = None,
                 margin: float = 1.5) -> ExitCode:
    """After the in-flight step: checkpoint (if it fits), requeue through the leader, return DRAINED.

    Every rank calls it with the same arguments (`save` may be collective and returns the name of the
    checkpoint that holds `step`); only the leader emits and requeues. `time_left_s` is the least
    KillWait left over all ranks after a SIGTERM (None otherwise).
    """
    on_sigterm = signal_name == "SIGTERM"
    saved = None
    if on_sigterm and time_left_s is not None and time_left_s < cost_s * margin:
        if is_leader:
            events.emit(run, events.DRAIN_CHECKPOINT_SKIPPED, step=step,
                        reason=f"{time_left_s:.1f} s of KillWait left < checkpoint cost {cost_s:.1f} s x {margin}: "
                               f"the restart resumes from the last periodic checkpoint")
    else:
        saved = save()
    if not is_leader:
        return ExitCode.DRAINED
    job_id = leader_job_id(env)
    requeued: str | bool = False
    if on_sigterm:
        requeued = SLURM_SIGTERM
    elif job_id is None:
        requeued = NOT_UNDER_SLURM
    else:
        try:
            requeue(job_id)
            requeued = True
        except SlurmCommandError as err:
            events.emit(run, events.REQUEUE_FAILED, step=step, job_id=job_id, error=str(err))
            return ExitCode.FAILED
        events.emit(run, events.REQUEUE, step=step, job_id=job_id, reason=reason)
    events.emit(run, events.DRAINED, step=step, reason=reason, signal=signal_name, job_id=job_id,
                checkpoint=saved, requeued=requeued)
    return ExitCode.DRAINED

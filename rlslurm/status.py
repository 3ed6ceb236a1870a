"""`rlslurm status <jobid|rundir>`: what a job is doing now, read from SLURM and its run directory.

SLURM side: the state of each het component (`scontrol show job` while slurmctld knows the job, then
sacct, or `sacct -c` where there is no accounting database), nodes and restarts. Run side:
the latest start, current step and phase per role from the heartbeats, the progress line (rlslurm/
progress.py), the last complete checkpoint, and the last events.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rlslurm.errors import SlurmCommandError, SlurmParseError
from rlslurm.events import BASE_FIELDS, PLAN_OFF, RANK_OUTLIVED_JOB, TRAINER_RESTARTED
from rlslurm.progress import Progress
from rlslurm.rundir import RunDir, find_run, read_jsonl, submitted_backend


@dataclass
class Status:
    """One snapshot of a job."""

    run_dir: Path
    job_id: str | None
    backend: str | None
    components: list[dict] = field(default_factory=list)
    restarts: int = 0
    roles: list[dict] = field(default_factory=list)
    checkpoint: str | None = None
    last_events: list[dict] = field(default_factory=list)
    slurm_error: str | None = None
    progress: str | None = None
    ops: list[str] = field(default_factory=list)
    """What is wrong with the ops kit itself this attempt: heartbeats that cannot be written, node agents that died."""
    excluded: list[dict] = field(default_factory=list)
    """Nodes a requeue asked SLURM to keep the job off, and its answer (<run>/excluded_nodes.json, slurm/rejoin.py)."""
    trainer_restarts: list[dict] = field(default_factory=list)
    """This allocation's `trainer_restarted` events: trainer ranks restarted in place (rlslurm/slurm/supervisor.py)."""
    outlived: list[dict] = field(default_factory=list)
    """`rank_outlived_job` events: ranks still running train.exit_grace_s after rank 0's clean exit, ended."""
    plan_off: list[dict] = field(default_factory=list)
    """`plan_off` events: figures the run measured more than 10 % off its plan (rlslurm/plan_vs_run.py)."""
    ended: str | None = None
    """How the job ended (`finished`, SLURM's final state), or None while it runs: a heartbeat that still says
    running then belongs to a process that ended without a word, never to a running one."""
    engines: list[str] = field(default_factory=list)
    """Rollout engines out of rotation for good in this attempt (`engine_down`), one line each, and who serves."""


def slurm_components(job_id: str) -> list[dict]:
    """State, partition, nodes and restarts of each component of a (het) job, newest source first."""
    from rlslurm.slurm import commands, parse

    rows = []
    try:
        for record in commands.show_job(job_id):
            rows.append({"job_id": record.get("JobId"), "component": record.get("HetJobOffset", "0"),
                         "state": record.get("JobState"), "reason": record.get("Reason"),
                         "partition": record.get("Partition"), "nodes": record.get("NodeList"),
                         "restarts": int(record.get("Restarts", "0") or 0)})
        return rows
    except SlurmCommandError as e:
        # Only slurmctld's own "Invalid job id" (gone past MinJobAge) sends us to accounting / the jobcomp
        # file. A controller that does not answer is not that: `sacct -c` reads a file and would answer
        # with nothing for a running job, and the SLURM lines would vanish without a word.
        if not parse.job_unknown(getattr(e, "stderr", "") or ""):
            raise
    except SlurmParseError:
        pass  # printed something we cannot read: accounting may still say it
    for record in commands.sacct([job_id]):
        rows.append({"job_id": record.get("JobID"), "component": parse.split_job_id(record.get("JobID", ""))[1] or 0,
                     "state": record.get("State"), "reason": None, "partition": record.get("Partition"),
                     "nodes": record.get("NodeList"), "restarts": None})
    return rows


def slurm_error_line(e: Exception) -> str:
    """What status says when SLURM gave no usable answer: the command, its error, how long it ran against
    the limit rlslurm gives every SLURM command, and that the lines below come from the run alone."""
    from rlslurm.slurm.commands import DEFAULT_TIMEOUT_S

    took = getattr(e, "duration_s", None)
    timing = f"timeout {DEFAULT_TIMEOUT_S:g} s per SLURM command"
    if took is not None:
        timing = f"after {took:.1f} s; {timing}"
    return (f"no answer about this job: {e} ({timing}); the lines below are the run directory's own "
            f"(heartbeats, checkpoints, events)")


def collect(target: str, run_root: str | Path | None = None) -> Status:
    """Everything `rlslurm status` shows."""
    from rlslurm.checkpoint import latest_complete
    from rlslurm.diag.heartbeat import read_heartbeats
    from rlslurm.events import read_events

    run, job_id = find_run(target, run_root)
    status = Status(run_dir=run.path, job_id=job_id, backend=submitted_backend(run))
    if job_id and status.backend == "slurm":
        try:
            status.components = slurm_components(job_id)
        except (SlurmCommandError, SlurmParseError) as e:
            status.slurm_error = slurm_error_line(e)
        status.restarts = max((c["restarts"] or 0 for c in status.components), default=0)
    starts = read_jsonl(run.jobs)
    status.restarts = max(status.restarts, max((s.get("restart_count") or 0 for s in starts), default=0))
    now = time.time()
    for hb in read_heartbeats(run):
        status.roles.append({"role": hb.get("role"), "rank": hb.get("rank"), "host": hb.get("host"),
                             "step": hb.get("step"), "phase": hb.get("phase"), "state": hb.get("state"),
                             "progress_age_s": round(now - hb.get("last_progress", now), 1)})
    ckpt = latest_complete(run, tidy=False)
    status.checkpoint = ckpt.path.name if ckpt else None
    all_events = read_events(run)
    status.last_events = all_events[-8:]
    status.ops = ops_problems(all_events)
    status.trainer_restarts = [e for e in all_events if TRAINER_RESTARTED.matches(e)
                               and e.get("restart_count") == status.restarts]
    status.outlived = [e for e in all_events if RANK_OUTLIVED_JOB.matches(e)]
    status.plan_off = [e for e in all_events if PLAN_OFF.matches(e)]
    status.ended = ended_as(status.components, all_events)
    status.engines = engines_out(all_events, status.roles)
    status.progress = Progress(run, total_steps=_total_steps(run)).poll()
    from rlslurm.slurm.rejoin import EXCLUDED

    with contextlib.suppress(OSError, ValueError):
        status.excluded = json.loads((run.path / EXCLUDED).read_text())
    return status


def ended_as(components: list[dict], all_events: list[dict]) -> str | None:
    """`finished` when the newest start finished (its `done`/`sft_finished` after it), else component 0's final
    SLURM state, else None (running, pending, requeued, or not known)."""
    from rlslurm import events
    from rlslurm.diag.summary import current_attempt
    from rlslurm.slurm.hetjob import FINAL_STATES

    now_events, _ = current_attempt(all_events)
    submitted = [i for i, e in enumerate(all_events) if events.SUBMITTED.matches(e)]
    after = all_events[submitted[-1]:] if submitted else all_events
    if events.select(now_events, *events.FINISHED) and events.select(after, *events.FINISHED):
        return "finished"
    first = next((c for c in components if str(c.get("component")) == "0"), None)
    state = str((first or {}).get("state") or "").split()[0] if first else ""
    return state if state in FINAL_STATES else None


def engines_out(all_events: list[dict], roles: list[dict]) -> list[str]:
    """This attempt's engines past their restart budget (`engine_down`): out of rotation for good, and the engines
    left serving (issue 38: the controller stops waiting for them; status says so)."""
    from rlslurm import events
    from rlslurm.diag.summary import current_attempt

    now_events, _ = current_attempt(all_events)
    down = {e.get("engine"): e for e in events.select(now_events, events.ENGINE_DOWN)}
    if not down:
        return []
    engines = sorted({r["rank"] for r in roles if r.get("role") == "rollout" and isinstance(r.get("rank"), int)}
                     | {i for i in down if isinstance(i, int)})
    left = [i for i in engines if i not in down]
    lines = [f"engine {i} down past rollout.max_restarts = {e.get('max_restarts')} ({e.get('restarts')} "
             f"replacements; last: {e.get('reason')}) at {_clock(e)}: out of rotation for good, not waited for"
             for i, e in sorted(down.items(), key=lambda x: str(x[0]))]
    lines.append(f"serving: {', '.join(f'engine {i}' for i in left)} ({len(left)} of {len(engines)})" if left
                 else "no engine left: the job fails (engine_failed)")
    return lines


def ops_problems(all_events: list[dict]) -> list[str]:
    """The ops kit's own failures in the current attempt (since the last start/resume), one line each: a
    heartbeat that still cannot be written (no `heartbeat_restored` after it), a node agent that died."""
    from rlslurm import events
    from rlslurm.diag.heartbeat import still_unwritable
    from rlslurm.diag.summary import current_attempt

    now_events, _ = current_attempt(all_events)
    lines = [f"heartbeat of {e.get('role')}-{e.get('rank')} (pid {e.get('pid')} on {e.get('host')}) cannot be "
             f"written since {_clock(e)}: {e.get('error')} ({e.get('path')}); the node agent does not judge it "
             f"by heartbeat age" for e in still_unwritable(now_events)]
    for e in events.select(now_events, events.NODE_AGENT_DIED):
        then = "restarted" if e.get("restarted") else "not restarted: hangs on this node go unwatched"
        lines.append(f"node agent pid {e.get('agent_pid')} on {e.get('node')} {e.get('cause')} at {_clock(e)}; "
                     f"{then} (log: {e.get('log')})")
    return lines


def _clock(event: dict) -> str:
    return time.strftime("%H:%M:%S", time.localtime(event.get("t", 0)))


def _total_steps(run: RunDir) -> int | None:
    try:
        steps = (yaml.safe_load(run.config.read_text()) or {}).get("train", {}).get("steps")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


def render(status: Status) -> str:
    """The human view."""
    lines = [f"run directory: {status.run_dir}",
             f"job: {status.job_id or '-'} ({status.backend or 'unknown backend'}), restarts: {status.restarts}"]
    if status.slurm_error:
        lines.append(f"SLURM: {status.slurm_error}")
    for c in status.components:
        reason = f" ({c['reason']})" if c.get("reason") not in (None, "None") else ""
        lines.append(f"  component {c['component']}: {c['state']}{reason} partition={c['partition']} "
                     f"nodes={c['nodes']}")
    if status.ended:
        lines.append(f"ended: {status.ended}")
    if status.roles:
        lines.append("roles:")
        for r in sorted(status.roles, key=lambda r: (str(r["role"]), r["rank"] or 0)):
            lines.append(f"  {r['role']}-{r['rank']} on {r['host']}: {_role_state(r, status.ended)}")
    if status.engines:
        lines.append("engines:")
        lines += [f"  {line}" for line in status.engines]
    if status.progress:
        lines.append(f"progress: {status.progress}")
    lines.append(f"last complete checkpoint: {status.checkpoint or 'none'}")
    if status.plan_off:
        off = ", ".join(f"{e.get('figure')} {e.get('measured'):.4g} measured vs {e.get('planned'):.4g} planned "
                        f"(x{e.get('ratio'):.2f})" for e in status.plan_off)
        lines.append(f"plan off by > 10 % at step {status.plan_off[0].get('step')}: {off}; "
                     f"calibrate: rlslurm plan CONFIG --from-run {status.run_dir}")
    if status.trainer_restarts:
        last = status.trainer_restarts[-1]
        lines.append(f"trainer restarted in this allocation: {len(status.trainer_restarts)} of "
                     f"{last.get('max_restarts')} (last: rank {last.get('dead_rank')} on {last.get('node')}, "
                     f"{last.get('cause')})")
    for e in status.outlived:
        lines.append(f"rank {e.get('stuck_rank')} (pid {e.get('pid')}) outlived the finished job by "
                     f"{e.get('grace_s')} s (train.exit_grace_s) and was ended ({e.get('ended')}); "
                     f"stacks: {e.get('stack_file')}")
    for x in status.excluded:
        what = (f"lost at restart {x.get('restart_count')} ({x.get('state')}: {x.get('reason')})")
        if x.get("excluded"):
            lines.append(f"kept off node {x.get('node')}: {what}; SLURM excluded it")
        else:
            why = f"SLURM refused: {x['refused']}" if x.get("refused") else x.get("not_asked", "not asked")
            lines.append(f"not kept off node {x.get('node')}: {what}; {why}")
    if status.ops:
        lines.append("ops kit:")
        lines += [f"  {line}" for line in status.ops]
    if status.last_events:
        lines.append("last events:")
        for e in status.last_events:
            lines.append(f"  {_clock(e)} {e.get('kind')} {e.get('role')}-{e.get('rank')} {_fields(e)}".rstrip())
    return "\n".join(lines) + "\n"


def _role_state(role: dict, ended: str | None) -> str:
    """A process's state as its heartbeat says it; `running` only while the job runs (issue 38: a finished
    job's status said running, step 2, of a process that had ended without writing its last heartbeat)."""
    state = role.get("state") or "unknown"
    where = f"step {role['step']} phase {role['phase']}"
    ago = f"{role['progress_age_s']} s ago"
    if state == "running" and ended:
        return f"not running: the job ended ({ended}); its heartbeat stopped at {where}, last progress {ago}"
    if state == "running":
        return f"running: {where} (last progress {ago})"
    return f"{state} at {where} (last progress {ago})"


def _fields(event: dict, most: int = 6) -> str:
    """An event's own fields, short: floats to 3 significant digits, at most `most` of them (the file has all)."""
    extra = [(k, v) for k, v in event.items() if k not in BASE_FIELDS]
    text = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra[:most]]
    if len(extra) > most:
        text.append(f"(+{len(extra) - most} more)")
    return " ".join(text)


def _submitted_at(run: RunDir) -> float:
    """When the run's newest job was submitted (its `submitted` event); 0 where none is recorded."""
    from rlslurm import events

    submitted = events.read_events(run, events.SUBMITTED)
    return submitted[-1]["t"] if submitted else 0.0


def job_ended(run: RunDir, job_id: str | None, backend: str | None, now: float, since: float,
              start_timeout_s: float = 120.0) -> str | None:
    """How the run's newest job (submitted at `since`) ended, or None while it may still run: SLURM's final
    state for a SLURM job (requeues are not an end); off SLURM `exited` once every process that beat since
    the submission is gone, or `never started` when none beat within start_timeout_s."""
    from rlslurm.diag.heartbeat import has_ended, pid_alive, read_heartbeats
    from rlslurm.slurm import hetjob

    if backend == "slurm" and job_id:
        return hetjob.final_state(job_id)
    beats = [hb for hb in read_heartbeats(run) if hb.get("written", 0.0) >= since]
    if any(not has_ended(hb) and pid_alive(hb) for hb in beats):
        return None
    if beats:
        return "exited"
    return "never started" if now - since > start_timeout_s else None


def follow(target: str, run_root: str | Path | None, show, *, poll_s: float = 2.0, timeout_s: float | None = None,
           clock=time.time, sleep=time.sleep) -> str:
    """`rlslurm status --follow`: `show(line)` the progress line until the job ends; returns how it ended
    (it finished: its last events say so), else raises JobFailedError naming the end and what to run next.
    `timeout_s` bounds the wait (RlslurmError past it); `sleep` is also where a test kicks its scheduler."""
    from rlslurm.errors import JobFailedError, RlslurmError

    run, job_id = find_run(target, run_root)
    backend = submitted_backend(run)
    since = _submitted_at(run)
    progress = Progress(run, total_steps=_total_steps(run))
    started = clock()
    while True:
        show(progress.poll())
        ended = job_ended(run, job_id, backend, clock(), since)
        if ended:
            break
        if timeout_s is not None and clock() - started > timeout_s:
            raise RlslurmError(f"job {job_id or '-'} of {run.path} still running after {timeout_s:.0f} s: "
                               f"{progress.line()}")
        sleep(poll_s)
    show(progress.poll())
    if progress.finished:
        return ended
    raise JobFailedError(f"job {job_id or '-'} of {run.path} ended ({ended}) without finishing: "
                         f"{progress.line()}; next: rlslurm diag {job_id or run.path}, then rlslurm resume "
                         f"{run.path} to go on from its last checkpoint")

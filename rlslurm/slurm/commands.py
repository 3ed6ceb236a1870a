"""The one seam through which rlslurm talks to SLURM: every sbatch / squeue / sacct / scontrol / scancel /
sinfo command, and `srun --overlap` into a running job (a live stack dump on its node), goes through `run()`;
the one long-running step, `srun --het-group=N` of a het component, through `srun_het_group()`.

    from rlslurm.slurm import commands
    job_id = commands.sbatch(["/runs/a b/job.sbatch"])            # -> "12"
    rows = commands.squeue([job_id])         # -> [{"JobID": "12", "HetJobOffset": "0", ...}, ...]
    commands.scancel(job_id, signal="USR1", batch=True)           # scancel -b -s USR1 12
    commands.scontrol("requeue", job_id)
    report = commands.job_report("sacct-c", job_id)               # unchecked, raw: a diag bundle keeps it

`run()` logs the command line (logger "rlslurm.slurm"), bounds it with a timeout, and raises
`SlurmCommandError` carrying `.argv`, `.returncode`, `.stderr` and `.duration_s` (how long it ran, None where
it never started) when the command fails, times out or is not installed. Parsing of what the commands
print lives in `rlslurm/slurm/parse.py` (pure functions).
Clients find the cluster through SLURM_CONF like any SLURM client; `env` overrides it per call.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from rlslurm.errors import SlurmCommandError
from rlslurm.slurm import parse

log = logging.getLogger("rlslurm.slurm")

DEFAULT_TIMEOUT_S = 30.0
"""A healthy slurmctld answers in milliseconds; 30 s means it is down or wedged, and waiting longer hides it."""

SQUEUE_FIELDS = ("JobID", "HetJobID", "HetJobOffset", "State", "Partition", "Name", "NodeList", "NumTasks",
                 "RestartCnt", "Reason")
"""Columns `squeue()` asks for (--Format names). A het component's JobID is its own id (4), HetJobID the
leader's (3); RestartCnt is the SLURM_RESTART_COUNT the job's next start sees. A '|' in a job name breaks it."""

SACCT_FIELDS = ("JobID", "JobName", "Partition", "State", "ExitCode", "NodeList", "Start", "End")

JOB_REPORTS = ("scontrol-show-job", "sacct", "sacct-c")
"""What SLURM can say of one job, newest source first: slurmctld (until MinJobAge after the end), the
accounting database (slurmdbd), the jobcomp file (`sacct -c`, where there is no database)."""
REPORT_SACCT_FIELDS = ("JobID", "JobName", "Partition", "State", "ExitCode", "Elapsed", "NodeList", "Start", "End")


@dataclass(frozen=True)
class CommandResult:
    """What one SLURM command printed."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float


def _error(argv: Sequence[str], returncode: int | None, stderr: str, why: str,
           duration_s: float | None = None) -> SlurmCommandError:
    err = SlurmCommandError(f"`{shlex.join(argv)}` {why}" + (f": {stderr.strip()}" if stderr.strip() else ""))
    err.argv = tuple(argv)
    err.returncode = returncode
    err.stderr = stderr
    err.duration_s = duration_s
    return err


def _ignore_sigterm() -> None:
    """In the child between fork and exec: an ignored signal stays ignored across exec."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run(argv: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, check: bool = True,
        env: Mapping[str, str] | None = None, ignore_sigterm: bool = False) -> CommandResult:
    """Run one SLURM command; raise SlurmCommandError (argv, returncode, stderr) unless it exits 0.
    `ignore_sigterm`: the command outlives a SIGTERM (the timeout still bounds it)."""
    argv = tuple(str(a) for a in argv)
    full_env = {**os.environ, **env} if env else None
    log.info("slurm: %s", shlex.join(argv))
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=full_env,
                              preexec_fn=_ignore_sigterm if ignore_sigterm else None)
    except FileNotFoundError as e:
        raise _error(argv, None, "", f"cannot run: {argv[0]} is not installed or not on PATH ({e})") from e
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise _error(argv, None, stderr, f"did not answer within {timeout_s:g} s (is slurmctld up? SLURM_CONF="
                     f"{(env or os.environ).get('SLURM_CONF', '<unset>')})", time.monotonic() - started) from e
    result = CommandResult(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)
    log.debug("slurm: exit %d in %.3f s", proc.returncode, result.duration_s)
    if check and proc.returncode != 0:
        raise _error(argv, proc.returncode, proc.stderr, f"exited {proc.returncode}", result.duration_s)
    return result


def sbatch(args: Sequence[str], **kw) -> str:
    """Submit with `sbatch --parsable ARGS`; return the job id (the leader's, for a het job)."""
    out = run(["sbatch", "--parsable", *args], **kw).stdout
    return parse.sbatch_parsable(out).job_id


def squeue(job_ids: Sequence[str] = (), *, fields: Sequence[str] = SQUEUE_FIELDS, **kw) -> list[dict[str, str]]:
    """Rows of `squeue --Format` for the jobs (all jobs when empty); a het job gives one row per component.

    squeue exits 1 for a job id it no longer knows (finished past MinJobAge): that is an empty answer.
    """
    fmt = ",".join(f"{f}:|" for f in fields)  # '|' as width suffix separates columns; see parse.squeue_format
    argv = ["squeue", "--noheader", f"--Format={fmt}"]
    if job_ids:
        argv.append("--jobs=" + ",".join(job_ids))
    result = run(argv, check=False, **kw)
    if result.returncode != 0:
        if parse.job_unknown(result.stderr):
            return []
        raise _error(result.argv, result.returncode, result.stderr, f"exited {result.returncode}", result.duration_s)
    return parse.squeue_format(result.stdout, fields)


def sacct(job_ids: Sequence[str], *, fields: Sequence[str] = SACCT_FIELDS, jobcomp: bool | None = None,
          **kw) -> list[dict[str, str]]:
    """Accounting rows for finished (and running) jobs.

    Without slurmdbd, `sacct` exits 1 ("accounting storage is disabled"); then `sacct -c` reads the
    jobcomp/filetxt file instead, which knows only finished jobs. jobcomp=True/False forces a source.
    """
    if jobcomp is not True:
        result = run(_sacct_argv(job_ids, fields, jobcomp=False), check=False, **kw)
        if result.returncode == 0:
            return parse.parsable2(result.stdout)
        if jobcomp is False or not parse.accounting_disabled(result.stderr):
            raise _error(result.argv, result.returncode, result.stderr, f"exited {result.returncode}",
                         result.duration_s)
        log.debug("slurm: accounting disabled, reading jobcomp with sacct -c")
    return parse.parsable2(run(_sacct_argv(job_ids, fields, jobcomp=True), **kw).stdout)


def _sacct_argv(job_ids: Sequence[str], fields: Sequence[str], *, jobcomp: bool) -> list[str]:
    argv = ["sacct", *(["-c"] if jobcomp else []), "--parsable2", "--noconvert", "--format=" + ",".join(fields)]
    for jid in job_ids:
        argv += ["-j", str(jid)]
    return argv


def job_report(kind: str, job_id: str, **kw) -> CommandResult:
    """One of SLURM's reports on a job (`kind` in JOB_REPORTS), unchecked and unparsed: the evidence a diag
    bundle keeps as SLURM printed it, error included (a job gone from slurmctld, accounting disabled).
    `parse.job_state(parse.scontrol_show(...))` / `parse.job_state(parse.parsable2(...))` read it."""
    if kind == "scontrol-show-job":
        return run(["scontrol", "show", "job", str(job_id)], check=False, **kw)
    if kind not in JOB_REPORTS:
        raise ValueError(f"unknown job report {kind!r}; one of {JOB_REPORTS}")
    return run(_sacct_argv([job_id], REPORT_SACCT_FIELDS, jobcomp=kind == "sacct-c"), check=False, **kw)


def scontrol(*args: str, **kw) -> str:
    """`scontrol ARGS`; its stdout."""
    return run(["scontrol", *args], **kw).stdout


def show_job(job_id: str, **kw) -> list[dict[str, str]]:
    """`scontrol show job -o ID` parsed: one record per het component (one for a plain job)."""
    return parse.scontrol_show(scontrol("show", "job", "-o", str(job_id), **kw))


def node_states(**kw) -> dict[str, str]:
    """node -> state (`idle`, `alloc`, `down`, ...) of every node, from `sinfo --Node`."""
    return parse.sinfo_node_states(run(["sinfo", "--Node", "--noheader", "--format=%N|%t"], **kw).stdout)


def show_node(node: str, **kw) -> list[dict[str, str]]:
    """`scontrol show node -o NAME` parsed (NodeAddr, State, Partitions, ...)."""
    return parse.scontrol_show(scontrol("show", "node", "-o", node, **kw))


def partition_nodes(partition: str, **kw) -> list[str]:
    """The nodes of a partition (`scontrol show partition -o NAME`, its Nodes= expanded)."""
    records = parse.scontrol_show(scontrol("show", "partition", "-o", partition, **kw))
    return [n for r in records for n in parse.expand_nodelist(r.get("Nodes", ""))]


def requeue(job_id: str, **kw) -> str:
    """`scontrol requeue ID` (a het job only through its leader): SIGTERM now, restart later. Returns what
    happened: the hang watchdog and the leader's drain both requeue, and the second finds the job pending
    again ("Job is pending execution"): that is the requeue done, not a failure."""
    # Asked from inside the job (the hang watchdog, a drain), the requeue SIGTERMs every process of the job,
    # scontrol among them: it raced its own answer and could report `exited -15` for a requeue that was done
    # (seen in CI). Ignoring SIGTERM lets it report; SLURM's SIGKILL after KillWait still ends it.
    kw.setdefault("ignore_sigterm", True)
    try:
        scontrol("requeue", str(job_id), **kw)
    except SlurmCommandError as e:
        if parse.already_pending(getattr(e, "stderr", "") or ""):
            return f"scontrol requeue {job_id}: already pending (requeued by another party of the job)"
        raise
    return f"scontrol requeue {job_id}"


def strigger_fini(job_id: str, program: Sequence[str], **kw) -> None:
    """`strigger --set --jobid=ID --fini --program=...`: slurmctld runs `program` (as the job's user, with the
    job id appended) when job ID ends; the triggers set on it before are cleared first (one of ours per job)."""
    run(["strigger", "--clear", f"--jobid={job_id}"], check=False, **kw)
    run(["strigger", "--set", f"--jobid={job_id}", "--fini", "--program=" + " ".join(program)], **kw)


def scancel(job_id: str, *, signal: str | None = None, batch: bool = False, full: bool = False,
            state: str | None = None, **kw) -> None:
    """`scancel [-s SIG] [-b|-f] [--state=S] ID`: with a signal, -b reaches the batch shell only, -f shell and
    steps, neither the steps only; without a signal the job is cancelled. `state`: only a job in that state."""
    argv = ["scancel"]
    if signal:
        argv += ["-s", signal]
    if batch:
        argv.append("-b")
    if full:
        argv.append("-f")
    if state:
        argv.append(f"--state={state}")
    run([*argv, str(job_id)], **kw)


def srun_overlap(job_id: str, argv: Sequence[str], *, node: str, het_group: int | None = None,
                 **kw) -> CommandResult:
    """`srun --jobid=J [--het-group=G] --overlap -N1 -n1 -w NODE ARGV`, unchecked: one task beside the running
    job's steps on NODE (its CPUs stay with the job). A het job is reached through its leader's id and the
    component's group; the component's own id is refused ("not heterogeneous job leader")."""
    group = [f"--het-group={het_group}"] if het_group is not None else []
    return run(["srun", f"--jobid={job_id}", *group, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                "--quiet", *argv], check=False, **kw)


def srun_het_group(group: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                   output: str | None = None, srun_args: Sequence[str] = ()) -> subprocess.Popen:
    """Start `srun --het-group=G --unbuffered --kill-on-bad-exit=0 [SRUN_ARGS] [--output O] ARGV` from inside a
    het job and return at once: the step that runs component G's tasks for as long as they run (its
    owner waits on or stops the Popen; rlslurm/slurm/hetjob.py ComponentStep). `env` is the whole
    environment of the step. SlurmCommandError when srun cannot be started.

    --kill-on-bad-exit=0: the tasks of a component are peers that serve alone (one engine each), and one that
    fails must not end the others (issue 38: an engine past its restart budget took the healthy one down).
    The srun runs in a session of its own (`step_session`): SLURM's signals to the batch step never reach it."""
    cmd = ["srun", f"--het-group={group}", "--unbuffered", "--kill-on-bad-exit=0", *srun_args]
    if output is not None:
        cmd += ["--output", str(output)]
    cmd = [str(a) for a in (*cmd, *argv)]
    log.info("slurm: %s", shlex.join(cmd))
    try:
        return subprocess.Popen(cmd, env=dict(env) if env is not None else None, **step_session())
    except OSError as e:
        raise _error(cmd, None, "", f"cannot run: {e}") from e


def step_session() -> dict:
    """Popen's arguments for an srun started from the batch step (the trainer step, a component's step): a
    session of its own.

    Why: `scancel --signal=TERM --full` signals the batch step (its session: measured on 22.05, the steps'
    tasks get nothing), and srun answers SIGTERM with "forcing job termination", a SIGKILL of every task of
    its step that SLURM carries out at once: a rank never got to its drain checkpoint (issue 38). An srun in a
    session of its own is not signalled; the trainer supervisor passes the SIGTERM on to every component's
    tasks (rlslurm/slurm/supervisor.py), which drain. (A job's termination, a requeue, a preemption, the time
    limit, signals every process of the job, this srun too: it says "forcing job termination" then as well,
    but SLURM, ending the step already, leaves the tasks their KillWait: measured.) The srun still ends with
    its step: its tasks end, at the latest at the end of the job."""
    return {"start_new_session": True}

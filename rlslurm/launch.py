"""`rlslurm submit`: validate, pre-flight, create the run directory, submit through submitit.

On SLURM the job is one heterogeneous job (rlslurm/slurm/hetjob.py): component 0 on the train partition
runs the trainer ranks (rank 0 is also the controller), component 1 on the rollout partition runs the
rollout engines, and a component 2 on `reward.partition` runs the reward service when
`reward.service = component`. Colocated (placement.mode = colocate) it is a plain job, component 0
alone, whose trainer rank 0 spawns the engines on its own node. With no SLURM (or `cluster.backend:
local`) the same entry function runs through submitit's local executor on this machine.

Every start of the job finds its way from the run directory alone (RLSLURM_RUN_DIR): the resolved
config, the plan, the job's secret (<run>/secret, mode 0600, made here once) and the checkpoints it
resumes from. `dry_run` (`rlslurm submit --dry-run`) validates and
pre-flights the same way, then shows the run directory, the layout and the sbatch script or local launch it
would use, and creates and submits nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shlex
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlslurm import events, secret
from rlslurm.config import JobConfig
from rlslurm.configfile import to_dict
from rlslurm.errors import JobFailedError, PreflightError, RlslurmError, RunDirError, SlurmCommandError
from rlslurm.layout import JobLayout
from rlslurm.rundir import ENV_VAR, RunDir, find_run, read_jsonl

log = logging.getLogger("rlslurm.launch")


@dataclass(frozen=True)
class Submission:
    """What submit returns: enough to follow the job."""

    job_id: str
    backend: str
    run_dir: Path
    job: object  # the submitit Job, to wait on its result
    notes: tuple[str, ...] = ()
    """Lines the command prints after the job id (resume: the checkpoint it goes on from, the ones it skips)."""


def resolve_backend(job: JobConfig, override: str | None = None) -> str:
    """slurm or local. auto = slurm where sbatch is on PATH and the controller answers `scontrol ping`."""
    backend = override or job.cluster.backend
    if backend != "auto":
        return backend
    if shutil.which("sbatch") is None:
        return "local"
    from rlslurm.slurm import commands

    try:
        out = commands.scontrol("ping", timeout_s=10)
    except SlurmCommandError:
        return "local"
    return "slurm" if " is UP" in out else "local"


def run_dir_path(job: JobConfig, root: str | Path | None = None) -> Path:
    """<run_root>/<job name>-<UTC time>[-n]: a path no run has yet (not created here)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        base = Path(root or job.cluster.run_root).resolve()
        path, n = base / f"{job.job.name}-{stamp}", 1
        while path.exists():
            n += 1
            path = base / f"{job.job.name}-{stamp}-{n}"
    except OSError as e:  # --run-root is not checked like cluster.run_root: a name too long, a loop
        raise RunDirError(f"cannot use the run root {str(root or job.cluster.run_root)[:200]!r} "
                          f"({e.strerror or e}); check cluster.run_root (or --run-root)") from None
    return path


def new_run_dir(job: JobConfig, root: str | Path | None = None) -> RunDir:
    """A fresh run directory (run_dir_path), never an existing run's."""
    path = run_dir_path(job, root)
    try:
        return RunDir(path).create()
    except OSError as e:
        raise RunDirError(f"cannot create the run directory {path} ({e.strerror or e}); "
                          "check cluster.run_root (or --run-root)") from None


def checked_plan(job: JobConfig, force: bool = False):
    """The job's plan and its pre-flight problems; PreflightError unless there are none or `force`."""
    from rlslurm.plan.report import build_plan, preflight

    plan = build_plan(job)
    problems = preflight(plan)
    if problems and not force:
        raise PreflightError("the plan says this job cannot run as configured:\n  - " + "\n  - ".join(problems)
                             + "\n(rlslurm plan shows the numbers; --force submits anyway)")
    return plan, problems


def prepare(job: JobConfig, *, config_text: str, force: bool = False, run_root: str | Path | None = None,
            backend: str | None = None):
    """Plan, pre-flight and a new run directory holding the config and the plan. Nothing is submitted.
    `backend` local: the machine must have the GPUs the layout asks (PreflightError before any directory)."""
    from rlslurm.plan.render import render_json

    plan, problems = checked_plan(job, force)
    if backend == "local":
        from rlslurm.devices import local_gpu_ids

        local_gpu_ids(JobLayout.decide(job, plan, "local"))
    run = new_run_dir(job, run_root)
    secret.ensure(run.secret)  # the job's secret: every server of the job requires it; requeues keep it
    run.config.write_text(yaml.safe_dump(to_dict(job), sort_keys=False))
    (run.path / "config.submitted.yaml").write_text(config_text)
    run.plan.write_text(render_json(plan))
    if problems:
        events.emit(run, events.PREFLIGHT_FORCED, problems=problems)
    return run, plan


def submit(job: JobConfig, *, config_text: str, force: bool = False, backend: str | None = None,
           run_root: str | Path | None = None) -> Submission:
    """Validate -> plan -> pre-flight -> run directory -> submit; returns the job id and run directory."""
    chosen = resolve_backend(job, backend)
    run, plan = prepare(job, config_text=config_text, force=force, run_root=run_root, backend=chosen)
    try:
        return _launch(job, run, plan, chosen)
    except BaseException as e:
        # Refused (sbatch said no: a partition that does not exist, a constraint SLURM rejects) or broken
        # off: the directory is removed, not kept and marked. It holds only what prepare wrote a moment ago
        # (config, plan, secret, layout), no job ever ran in it, and the error carries SLURM's own words; a
        # kept one would be one more "run" for status, resume and the job-id lookup to tell apart forever.
        shutil.rmtree(run.path, ignore_errors=True)
        if isinstance(e, RlslurmError):
            said = type(e)(f"{e}\nnothing was submitted; the run directory {run.path} was removed")
            said.__dict__.update(e.__dict__)  # a SlurmCommandError's argv, returncode, stderr
            raise said from e
        raise


def _launch(job: JobConfig, run: RunDir, plan, backend: str, **record) -> Submission:
    """Submit the run's job on `backend` and record it (submissions.jsonl, a `submitted` event)."""
    lay = JobLayout.decide(job, plan, backend)
    lay.write(run)  # before the job starts: every process of it reads its layout from here
    sub = _submit_slurm(job, run, lay) if backend == "slurm" else _submit_local(job, run, lay)
    run.append_json(run.path / "submissions.jsonl",
                    {"t": time.time(), "job_id": sub.job_id, "backend": backend, "layout": lay.to_dict(), **record})
    events.emit(run, events.SUBMITTED, job_id=sub.job_id, backend=backend, layout=lay.to_dict(), **record)
    return sub


def resume(target: str, *, overrides: tuple[str, ...] = (), force: bool = False, backend: str | None = None,
           run_root: str | Path | None = None, clock=time.time) -> Submission:
    """Submit a run that stopped for good (finished, drained or failed off SLURM, cancelled, or stopped
    for lack of progress) again, into its own run directory: it starts from the newest complete checkpoint
    there, as a requeue would. `overrides` change its config (e.g. train.steps=120 trains on); validated
    and pre-flighted like a new submission. Refused while a job of the run still shows signs of life."""
    from rlslurm.config import load_config
    from rlslurm.data.check import check_data
    from rlslurm.plan.render import render_json
    from rlslurm.status import slurm_components

    run, previous = find_run(target, run_root)
    job = load_config(run.config, overrides)
    check_data(job)  # as submit does: a bad data file (or a --set data.train=...) is refused before anything
    plan, problems = checked_plan(job, force)
    last = (read_jsonl(run.path / "submissions.jsonl") or [{}])[-1]
    alive = signs_of_life(run, job, clock())
    if not alive and last.get("backend") == "slurm" and previous:
        try:
            states = {c["state"] for c in slurm_components(previous)}
        except RlslurmError:
            states = set()
        if states & _SLURM_LIVE:
            alive = f"SLURM says job {previous} is {', '.join(sorted(states & _SLURM_LIVE))}"
    if alive:
        raise RlslurmError(f"run {run.path} is not stopped: {alive}. Two jobs must not write one run directory: "
                           f"rlslurm drain {previous or run.path} (or scancel) first, then resume")
    # A resubmission SLURM refuses leaves the stopped run as it was (its config, plan, starts, events and
    # layout): the run directory is the user's and holds checkpoints, so unlike a new submission's it stays.
    with restored_on_failure(run.config, run.plan, run.jobs, run.events, run.layout):
        if overrides:
            run.config.write_text(yaml.safe_dump(to_dict(job), sort_keys=False))
            run.plan.write_text(render_json(plan))
            events.emit(run, events.CONFIG_CHANGED, overrides=list(overrides))
        if problems:
            events.emit(run, events.PREFLIGHT_FORCED, problems=problems)
        secret.ensure(run.secret)  # the run's own secret again (made here for a run submitted before there was one)
        # A new series of starts: the no-progress count (lifecycle.on_start) does not reach back past it.
        run.record_start(resubmitted=True, after_job_id=previous, step=None)
        sub = _launch(job, run, plan, resolve_backend(job, backend or last.get("backend")), resume_of=previous)
    return dataclasses.replace(sub, notes=resume_notes(run))


def resume_notes(run: RunDir) -> tuple[str, ...]:
    """What a resume goes on from, said on the command's own output: the newest complete checkpoint, and each
    newer one it skips with the reason (the job skips the same ones at its start, with `checkpoint_skipped`
    events, and renames a damaged one aside; this look changes nothing)."""
    from rlslurm.checkpoint import survey

    found = survey(run)
    lines = [f"skips checkpoint {s['checkpoint']} (step {s['step']}): {s['reason']}" for s in found.skipped]
    if found.chosen is None:
        return (*lines, "resumes from: no complete checkpoint, training starts at step 0")
    return (*lines, f"resumes from: checkpoint {found.chosen.path.name} (step {found.chosen.step})")


@contextlib.contextmanager
def restored_on_failure(*paths: Path) -> Iterator[None]:
    """Put each file back as it was (bytes, or absent) when the body raises; small files of a stopped run."""
    saved = {path: path.read_bytes() if path.is_file() else None for path in paths}
    try:
        yield
    except BaseException:
        for path, data in saved.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(data)
        raise


_SLURM_LIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED",
               "COMPLETING", "CONFIGURING", "STOPPED", "SIGNALING"}


def signs_of_life(run: RunDir, job: JobConfig, now: float) -> str | None:
    """Why the run's processes look alive (a heartbeat newer than a few beats that is not its process's last
    word, `exited` or `failed`, and whose process is not known gone: a SIGKILLed one writes no last word), or
    None."""
    from rlslurm.diag.heartbeat import gone_here, has_ended, read_heartbeats

    fresh_s = max(10.0, 5 * job.diag.heartbeat_interval_s)
    for hb in read_heartbeats(run):
        age = now - hb.get("written", 0.0)
        if not has_ended(hb) and age < fresh_s and not gone_here(hb):
            return f"{hb.get('role')}-{hb.get('rank')} (pid {hb.get('pid')} on {hb.get('host')}) beat {age:.1f} s ago"
    return None


def dry_run(job: JobConfig, *, force: bool = False, backend: str | None = None,
            run_root: str | Path | None = None) -> str:
    """What `submit` would do, as text: backend, run directory, layout, pre-flight, and the sbatch script (SLURM)
    or the local launch. Validates and pre-flights like submit; creates no run directory, submits nothing."""
    plan, problems = checked_plan(job, force)
    chosen = resolve_backend(job, backend)
    lay = JobLayout.decide(job, plan, chosen)
    path = run_dir_path(job, run_root)
    lines = ["dry run: nothing submitted, no run directory created",
             f"job {job.job.name!r} ({job.job.kind}) on {chosen}; placement {plan.placement}, sync {plan.sync_method}",
             f"run directory would be: {path}",
             "layout: " + ", ".join(f"{k} = {v}" for k, v in lay.to_dict().items()),
             "preflight: " + ("ok" if not problems else "forced past: " + "; ".join(problems))]
    if chosen == "slurm":
        from rlslurm.slurm.hetjob import ScriptRenderer, submission_script

        script = submission_script(_slurm_executor(job, path, lay, ScriptRenderer))
        lines += ["sbatch script:", script.rstrip("\n")]
    else:
        from rlslurm.devices import local_gpu_ids
        from rlslurm.network import network_env

        gpus = local_gpu_ids(lay)  # refused as submit would refuse it: this machine lacks the GPUs
        engines = (f"rank 0 spawns {lay.engines} rollout engine(s) beside it" if job.job.kind == "rl"
                   else "no rollout")
        net = "".join(f" {k}={shlex.quote(v)}" for k, v in network_env(job.network).items())
        lines += ["local launch (submitit's LocalExecutor on this machine):",
                  f"  {lay.train_world} task(s) of rlslurm.jobs.entry.run_component({str(path)!r}), timeout "
                  f"{job.cluster.time_limit_min} min; {engines}",
                  f"  GPUs: {','.join(map(str, gpus)) or 'none'} of this machine's (CUDA_VISIBLE_DEVICES of every "
                  f"task; each rank takes its local rank's); engines' positions among them {lay.spawned_engine_gpus}",
                  f"  env: {ENV_VAR}={shlex.quote(str(path))} MASTER_ADDR=127.0.0.1 MASTER_PORT=<a free port>{net}",
                  f"  logs: {path / 'logs' / 'submitit'}"]
    return "\n".join(lines) + "\n"


def _slurm_executor(job: JobConfig, run_path: Path, lay: JobLayout, executor_class=None):
    """The het-job executor of this job, its parameters set (components 1 and 2 as the layout says)."""
    from rlslurm.slurm.hetjob import Component, HetSlurmExecutor

    cl = job.cluster
    extra = []
    if lay.rollout_nodes:
        extra.append(Component(partition=cl.rollout_partition, nodes=lay.rollout_nodes,
                               ntasks_per_node=lay.rollout_tasks_per_node, cpus_per_task=cl.cpus_per_task,
                               mem_gb=cl.mem_gb, gres=cl.gres_per_node,
                               gpus_per_node=lay.rollout_gpus_per_node or None))
    if lay.reward_component:
        if not lay.rollout_nodes:
            raise PreflightError("reward.service = 'component' needs a rollout component too (het component 2 "
                                 "follows component 1); use reward.service: local with colocated rollout")
        extra.append(Component(partition=job.reward.partition or "", nodes=1, ntasks_per_node=1,
                               cpus_per_task=cl.cpus_per_task))
    try:
        executor = (executor_class or HetSlurmExecutor)(run_path / "logs" / "submitit", components=extra)
    except RuntimeError as e:  # submitit's SlurmExecutor: no srun on this machine
        raise SlurmCommandError(f"cannot submit to SLURM from here: {e} (--backend local runs on this machine)") \
            from None
    params: dict = dict(partition=cl.train_partition, nodes=lay.train_nodes, ntasks_per_node=lay.train_tasks_per_node,
                        cpus_per_task=cl.cpus_per_task, time=cl.time_limit_min, job_name=job.job.name,
                        # USR1 to every task (not only the batch shell): each rank's drain gate sees it.
                        additional_parameters={"requeue": True, "signal": f"USR1@{cl.signal_before_s}"},
                        setup=[f"export {ENV_VAR}={shlex.quote(str(run_path))}",
                               "export RLSLURM_LEADER_JOB_ID=${SLURM_JOB_ID}", *_env_exports(job, lay)])
    if lay.train_gpus_per_node:
        params["gpus_per_node"] = lay.train_gpus_per_node
    if cl.mem_gb:
        params["mem"] = f"{int(cl.mem_gb)}GB"
    if cl.gres_per_node:
        params["gres"] = cl.gres_per_node
    for option in cl.extra_sbatch:
        key, _, value = option.lstrip("-").partition("=")
        params["additional_parameters"][key.replace("-", "_")] = value or True
    executor.update_parameters(**params)
    return executor


def _env_exports(job: JobConfig, lay: JobLayout) -> list[str]:
    """The batch shell's exports that every step of the job inherits: the network environment
    (rlslurm/network.py), and no GPU for a job that asks none (a node without GRES would otherwise pass on
    whatever the submitting shell had)."""
    from rlslurm.network import network_env

    lines = [f"export {name}={shlex.quote(value)}" for name, value in network_env(job.network).items()]
    return lines + ([] if lay.train_gpus_per_node else ["export CUDA_VISIBLE_DEVICES="])


def _submit_slurm(job: JobConfig, run: RunDir, lay: JobLayout) -> Submission:
    from rlslurm.jobs.entry import run_component

    sjob = _slurm_executor(job, run.path, lay).submit(run_component, str(run.path))
    return Submission(job_id=str(sjob.job_id), backend="slurm", run_dir=run.path, job=sjob)


def _submit_local(job: JobConfig, run: RunDir, lay: JobLayout) -> Submission:
    from rlslurm.devices import local_gpu_ids
    from rlslurm.jobs.entry import run_component
    from rlslurm.local_supervisor import RestartingLocalExecutor
    from rlslurm.network import network_env

    # submitit's local executor with a controller that restarts crashed ranks (rlslurm/local_supervisor.py).
    executor = RestartingLocalExecutor(folder=run.logs / "submitit")
    # The local executor gives tasks only SUBMITIT_LOCAL_* variables; rlslurm/dist.py maps them. Every task
    # sees the job's GPUs of this machine (gpus_per_node of visible_gpus; none: an empty CUDA_VISIBLE_DEVICES)
    # and takes its local rank's (rlslurm/devices.py).
    gpus = local_gpu_ids(lay)
    executor.update_parameters(tasks_per_node=lay.train_world, nodes=1, timeout_min=job.cluster.time_limit_min,
                               gpus_per_node=len(gpus), visible_gpus=gpus)
    from rlslurm.dist import free_port

    # Local tasks inherit this process's environment at submit time (submitit starts them inside submit).
    # Put it back afterwards: a MASTER_PORT left behind would be exported by sbatch into every later
    # SLURM job of this process, and rlslurm/dist.py prefers it to the per-job port.
    job_env = {ENV_VAR: str(run.path), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               **network_env(job.network)}
    saved = {key: os.environ.get(key) for key in job_env}
    os.environ.update(job_env)
    try:
        sjob = executor.submit(run_component, str(run.path))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return Submission(job_id=str(sjob.job_id), backend="local", run_dir=run.path, job=sjob)


def describe(sub: Submission) -> str:
    """The lines submit prints: job id, run directory, how to follow it."""
    return "\n".join([
        f"submitted {sub.backend} job {sub.job_id}",
        f"run directory: {sub.run_dir}",
        *sub.notes,
        f"follow: rlslurm status {shlex.quote(str(sub.run_dir))} --follow",
    ])


def wait(sub: Submission, timeout_s: float | None = None, poll_s: float = 2.0,
         on_poll: Callable[[], None] | None = None) -> object:
    """Block until the job's component 0 finished (bounded, logged); returns its result or raises.
    `on_poll` runs at every poll (`rlslurm submit --wait` prints the progress line there)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not _finished(sub):
        if deadline is not None and time.monotonic() > deadline:
            raise RlslurmError(f"job {sub.job_id} still running after {timeout_s:.0f} s; run dir {sub.run_dir}")
        log.info("waiting for job %s (%s)", sub.job_id, sub.run_dir)
        if on_poll is not None:
            on_poll()
        time.sleep(poll_s)
    from submitit.core.utils import FailedJobError, UncompletedJobError

    try:
        return sub.job.results()
    except (FailedJobError, UncompletedJobError) as e:
        raise JobFailedError(failure_message(sub.job_id, sub.run_dir, str(e))) from e


def _finished(sub: Submission) -> bool:
    """submitit's done(), and on SLURM the job's own final state too: a job that drained and requeued
    itself has left its first allocation's result behind (submitit calls that done) but is coming back."""
    if not sub.job.done():
        return False
    if sub.backend != "slurm":
        return True
    from rlslurm.slurm import hetjob

    try:
        return hetjob.final_state(sub.job_id) is not None
    except RlslurmError as e:
        log.warning("job %s: SLURM state unknown (%s); taking submitit's word that it is done", sub.job_id, e)
        return True


def check_results(sub: Submission, results) -> None:
    """Raise JobFailedError unless every task of the job exited 0 (DONE): a job that drained or hung
    and was not requeued ended without finishing; its exit codes (lifecycle.ExitCode) say why."""
    from rlslurm.lifecycle import ExitCode

    codes = [int(r) for r in results] if isinstance(results, (list, tuple)) else [int(results or 0)]
    if any(codes):
        names = sorted({ExitCode(c).name if c in ExitCode._value2member_map_ else str(c) for c in codes if c})
        raise JobFailedError(f"job {sub.job_id} ended without finishing: exit codes {codes} ({', '.join(names)}); "
                             f"run directory {sub.run_dir} (its checkpoints are kept); next: rlslurm diag "
                             f"{sub.job_id}, and rlslurm resume {sub.run_dir} to go on from its last checkpoint")


_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)): (.*)$")
_LOG_PATH = re.compile(r"^\s*-\s*(\S+\.(?:err|out))\s*$")


def root_cause(trace: str) -> str | None:
    """The last `SomethingError: message` line of a traceback as submitit reports it (its own wrapper's
    lines skipped), or None."""
    found = None
    for line in trace.splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m and m.group(1) not in ("FailedJobError", "UncompletedJobError"):
            found = f"{m.group(1)}: {m.group(2)}"
    return found


def failure_message(job_id: str, run_dir: Path, trace: str, tail_lines: int = 8) -> str:
    """What `--wait` says of a failed job: the root cause, the logs it names with their last lines, and
    where to look next."""
    logs = [Path(m.group(1)) for m in map(_LOG_PATH.match, trace.splitlines()) if m]
    lines = [f"job {job_id} failed: {root_cause(trace) or trace.strip().splitlines()[0]}",
             f"  run directory: {run_dir}"]
    for path in logs:
        if path.suffix == ".err" and path.is_file():
            tail = path.read_text(errors="replace").splitlines()[-tail_lines:]
            lines.append(f"  last lines of {path}:")
            lines += [f"    {t}" for t in tail]
        else:
            lines.append(f"  log: {path}")
    lines.append(f"  next: rlslurm diag {job_id}   (the whole story: events, stacks, logs)")
    return "\n".join(lines)

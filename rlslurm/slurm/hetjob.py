"""Heterogeneous SLURM jobs through submitit: `HetSlurmExecutor` is submitit's SlurmExecutor (same
pickles, logs, results, USR2 checkpoint-and-requeue) whose sbatch script asks for 2 or 3 components.

Submit (from the login node)::

    from rlslurm.slurm.hetjob import Component, HetSlurmExecutor
    ex = HetSlurmExecutor("/runs/x/logs/submitit",                          # shared folder (spaces OK)
                          components=[Component(partition="rollout", nodes=1, ntasks_per_node=2),
                                      Component(partition="cpu")])          # optional component 2
    ex.update_parameters(                    # component 0, with submitit SlurmExecutor's (sbatch) names
        partition="train", nodes=2, ntasks_per_node=1, cpus_per_task=1, time=60,   # time in minutes
        job_name="rl", signal_delay_s=90,                                   # --signal=USR2@90 (submitit's)
        additional_parameters={"requeue": True},                            # --requeue
        setup=["export RLSLURM_RUN_DIR='/runs/x'"])                         # extra env, in the batch shell
    job = ex.submit(fn, *args)       # job.job_id = the het leader; job.result() as with submitit
    # --open-mode=append is always on (submitit's default); --signal may be replaced through
    # additional_parameters={"signal": "B:USR1@60"} (then submitit's own USR2 handler never fires).
    # mem is a string here ("64GB"); Component(mem_gb=...) converts for components 1 and 2.

`fn` runs in every task of component 0 (one `srun --het-group=0 --kill-on-bad-exit=1`, which the script runs
under the trainer supervisor, rlslurm/slurm/supervisor.py: it starts rlslurm's further components and runs the
step again when a rank dies). Inside it::

    ctx = hetjob.context()           # HetContext: this task's group, rank, world, node, restart_count,
                                     # leader_job_id and components[i] (job_id, partition, nodes, ntasks)
    if ctx.group == 0 and ctx.rank == 0:
        step = hetjob.launch_component(1, [sys.executable, "-m", "my.server"], env={"PORT": "8000"})
        ...                          # one `srun --het-group=1` step: every task of component 1
        step.stop(timeout_s=30)      # SIGTERM to its tasks (scancel -s TERM), SIGKILL after timeout_s

A task started by launch_component sees RLSLURM_HET_GROUP=N, so `hetjob.context()` works there too;
SLURM_PROCID / SLURM_NTASKS of its step are its rank / world inside the component. Slurm 22.05 never
sets SLURM_HET_JOB_ID / SLURM_HET_JOB_OFFSET, so the group comes from RLSLURM_HET_GROUP and the layout
from the batch shell's SLURM_*_HET_GROUP_<n> variables, which every step inherits.

Requeue (`scontrol requeue <leader>`, preemption, submitit's own on USR2) restarts the whole het job
with SLURM_RESTART_COUNT=1, 2, ...; with `--requeue` the job keeps its id and appends to its logs.
An external requeue or preemption sends SIGTERM, which submitit ignores: the tasks die after KillWait and
the restart runs the *original* pickle, so resume must come from the run directory's checkpoints
(measured on the local cluster: ~12 s from `scontrol requeue` to the restarted function).
For hand submission: sbatch/hetjob.sbatch.template. Golden scripts: tests/golden/*.sbatch.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import time
import typing as tp
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from submitit.core import core, utils
from submitit.slurm import slurm as submitit_slurm

from rlslurm.errors import RlslurmError, SlurmCommandError
from rlslurm.slurm import commands, parse

log = logging.getLogger("rlslurm.slurm.hetjob")

GROUP_ENV = "RLSLURM_HET_GROUP"
SUPERVISOR = "rlslurm.slurm.supervisor"
"""The module the batch shell runs the trainer step under (rlslurm/slurm/supervisor.py)."""


@dataclass(frozen=True, kw_only=True)
class Component:
    """One further component (1, 2) of a het job; component 0 is set with update_parameters."""

    partition: str
    """SLURM partition of this component; it must not share nodes with the other components'."""
    nodes: int = 1
    """Nodes of this component."""
    ntasks_per_node: int = 1
    """Tasks per node that `launch_component` starts."""
    cpus_per_task: int | None = None
    """CPUs per task; None = the partition's default."""
    mem_gb: float | None = None
    """Memory per node in GB; None = the partition's default."""
    gres: str | None = None
    """GRES per node other than GPUs, e.g. nvme:1."""
    gpus_per_node: int | None = None
    """GPUs per node (--gpus-per-node); None = none."""
    extra: dict[str, str | bool] = field(default_factory=dict)
    """Further sbatch options of this component, e.g. {"constraint": "h100"} (True = a bare flag)."""

    def __post_init__(self):
        if not self.partition:
            raise RlslurmError("Component.partition must not be empty")
        if self.nodes < 1 or self.ntasks_per_node < 1:
            raise RlslurmError(f"Component {self.partition}: nodes and ntasks_per_node must be >= 1")

    def directives(self, time_min: int | None) -> list[str]:
        opts: dict[str, tp.Any] = {"partition": self.partition, "nodes": self.nodes,
                                   "ntasks-per-node": self.ntasks_per_node}
        if self.cpus_per_task is not None:
            opts["cpus-per-task"] = self.cpus_per_task
        if self.mem_gb is not None:
            opts["mem"] = submitit_slurm._convert_mem(self.mem_gb)
        if self.gres:
            opts["gres"] = self.gres
        if self.gpus_per_node:
            opts["gpus-per-node"] = self.gpus_per_node
        if time_min is not None:  # each component has its own limit; the same for all keeps them together
            opts["time"] = time_min
        opts.update(self.extra)
        return [submitit_slurm._as_sbatch_flag(k, v) for k, v in opts.items()]


class HetInfoWatcher(submitit_slurm.SlurmInfoWatcher):
    """Job states from squeue (which knows finished jobs for MinJobAge), then sacct / jobcomp."""

    def update(self) -> None:
        ids = sorted({x.split("_")[0] for x in self._registered - self._finished})
        if not ids:
            return
        self._num_calls += 1
        try:
            self._info_dict.update(job_states(ids))
        except (SlurmCommandError, parse.SlurmParseError) as e:
            log.warning("job state query failed (%s); state may be stale", e)
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)


class HetSlurmJob(submitit_slurm.SlurmJob[core.R]):
    """A submitted het job, named by its leader's id."""

    watcher = HetInfoWatcher(delay_s=60)

    def cancel(self, check: bool = True) -> None:
        commands.scancel(self.job_id, check=check)


def job_states(leader_ids: tp.Sequence[str]) -> dict[str, dict[str, str]]:
    """{leader id: {"State", "NodeList", "Partition"}} of component 0, from squeue, else sacct (-c)."""
    out: dict[str, dict[str, str]] = {}
    fields = ("JobID", "HetJobID", "HetJobOffset", "State", "Partition", "NodeList")
    for row in commands.squeue(leader_ids, fields=fields):
        leader = row["HetJobID"] if row["HetJobID"] not in ("", "0", "N/A") else row["JobID"]
        if row["HetJobOffset"] in ("0", "N/A", ""):
            out[leader] = {"State": row["State"], "NodeList": row["NodeList"], "Partition": row["Partition"]}
    missing = [j for j in leader_ids if j not in out]
    if missing:  # past MinJobAge: accounting, or the jobcomp file (which names component 0 by the leader id)
        for row in commands.sacct(missing, fields=("JobID", "State", "NodeList", "Partition")):
            if row["JobID"] in missing:
                out[row["JobID"]] = {"State": row["State"].split()[0], "NodeList": row["NodeList"],
                                     "Partition": row["Partition"]}
    return out


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED"}
"""States a SLURM job does not leave (a requeued job goes PENDING, not PREEMPTED)."""


def final_state(leader_id: str) -> str | None:
    """The job's final state (e.g. COMPLETED; UNKNOWN where SLURM no longer knows the job), or None while
    it is not final (pending, running, requeued)."""
    state = job_states([leader_id]).get(leader_id, {}).get("State")
    if state is None:
        return "UNKNOWN"
    state = state.split()[0]
    return state if state in FINAL_STATES else None


class HetSlurmExecutor(submitit_slurm.SlurmExecutor):
    """submitit's SlurmExecutor for a heterogeneous job: component 0 from its parameters, then one
    `#SBATCH hetjob` block per entry of `components` (none: a plain job). All SLURM commands go through
    commands.py."""

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, components: tp.Sequence[Component], *, max_num_timeout: int = 3,
                 python: str | None = None) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout, python=python)
        # No further component is a plain job through the same seams (colocated rollout runs inside it).
        if not 0 <= len(components) <= 2:
            raise RlslurmError(f"a het job here has 1 to 3 components: got {len(components)} besides component 0")
        self.components = tuple(components)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        params = dict(self.parameters)
        # Without --het-group=0 a bare srun would start the pickled function in component 0 anyway, but
        # saying so keeps it there if SLURM's default ever changes, and reads right in the script.
        # --kill-on-bad-exit=1: one dead trainer rank ends the step at once (its peers would wait in a gloo
        # collective for train.dist_timeout_s), and the trainer supervisor restarts it (rlslurm/slurm/supervisor.py).
        params["srun_args"] = [*(["--het-group=0"] if self.components else []), "--kill-on-bad-exit=1",
                               *(params.get("srun_args") or [])]
        text = submitit_slurm._make_sbatch_string(command=command, folder=self.folder, **params)
        lines = text.split("\n")
        # The trainer step runs under the trainer supervisor, which outlives it: it starts the other components
        # once and restarts dead trainer ranks inside the allocation. `exec`: SLURM's SIGTERM reaches it.
        srun = max(i for i, ln in enumerate(lines) if ln.startswith("srun "))
        python = shlex.split(command)[0]
        lines[srun:srun] = [f"exec {shlex.quote(python)} -u -m {SUPERVISOR} -- \\"]
        last = max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
        extra: list[str] = []
        for i, comp in enumerate(self.components, start=1):
            extra += ["#SBATCH hetjob", f"# component {i}: {comp.partition}", *comp.directives(params.get("time"))]
        lines[last + 1:last + 1] = extra
        text = "\n".join(lines)
        # The batch shell and component 0's tasks learn their group here (22.05 sets no SLURM_HET_JOB_OFFSET).
        executor = "export SUBMITIT_EXECUTOR=slurm"
        return text.replace(executor, f"{executor}\nexport {GROUP_ENV}=0", 1)

    def _submit_command(self, command: str) -> core.Job[tp.Any]:
        # submitit's own version runs sbatch through its CommandFunction; this one goes through the seam.
        tmp_uuid = uuid.uuid4().hex
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        script = folder / f".submission_file_{tmp_uuid}.sh"
        script.write_text(self._make_submission_file_text(command, tmp_uuid))
        job_id = commands.sbatch([str(script)])
        job: core.Job[tp.Any] = self.job_class(folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks())))
        job.paths.move_temporary_file(script, "submission_file", keep_as_symlink=True)
        self._write_job_id(job.job_id, tmp_uuid)
        self._set_job_permissions(job.paths.folder)
        log.info("submitted %s %s (%s)", "het job" if self.components else "job", job_id,
                 " + ".join([str(self.parameters.get("partition")), *(c.partition for c in self.components)]))
        return job

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        return parse.sbatch_parsable(string.decode() if isinstance(string, bytes) else string).job_id


class ScriptRenderer(HetSlurmExecutor):
    """The executor of a submission that is only shown (`rlslurm submit --dry-run`): same script, no sbatch,
    and it renders where srun is missing too (a login node or laptop without SLURM)."""

    @classmethod
    def affinity(cls) -> int:
        return 1

    def _submit_command(self, command: str) -> core.Job[tp.Any]:
        raise RlslurmError("a dry run submits nothing")


def submission_script(executor: HetSlurmExecutor) -> str:
    """The sbatch script `executor.submit` would hand to sbatch (its submitit command included)."""
    return executor._make_submission_file_text(executor._submitit_command_str, "dry-run")


@dataclass(frozen=True)
class ComponentInfo:
    """One component as the batch shell sees it."""

    group: int
    job_id: str
    partition: str
    nodelist: str
    nodes: tuple[str, ...]
    ntasks: int


@dataclass(frozen=True)
class HetContext:
    """Where the calling task sits in the het job."""

    leader_job_id: str
    group: int
    rank: int
    world: int
    local_rank: int
    node: str
    restart_count: int
    components: tuple[ComponentInfo, ...]


def components_from_env(env: tp.Mapping[str, str]) -> tuple[ComponentInfo, ...]:
    """The components of the het job from SLURM_HET_SIZE and SLURM_*_HET_GROUP_<n>."""
    try:
        size = int(env["SLURM_HET_SIZE"])
    except (KeyError, ValueError) as e:
        raise RlslurmError("not inside a heterogeneous SLURM job: SLURM_HET_SIZE is not set") from e
    out = []
    for g in range(size):
        def get(name: str, g: int = g) -> str:
            key = f"SLURM_{name}_HET_GROUP_{g}"
            if key not in env:
                raise RlslurmError(f"het job component {g}: {key} is not set")
            return env[key]
        nodelist = get("JOB_NODELIST")
        out.append(ComponentInfo(g, get("JOB_ID"), get("JOB_PARTITION"), nodelist,
                                 tuple(parse.expand_nodelist(nodelist)), int(get("NTASKS"))))
    return tuple(out)


def component_job_id(env: tp.Mapping[str, str] | None = None) -> str | None:
    """SLURM's own id of this task's component (13 for component 1 of het job 12); SLURM_JOB_ID outside a
    het job; None off SLURM. Not SLURM_JOB_ID alone: a component's step that component 0 starts sees the
    leader's there (measured on 22.05), its own id only in SLURM_JOB_ID_HET_GROUP_<group>."""
    env = os.environ if env is None else env
    return env.get(f"SLURM_JOB_ID_HET_GROUP_{env.get(GROUP_ENV, '0')}") or env.get("SLURM_JOB_ID")


def context(env: tp.Mapping[str, str] | None = None) -> HetContext:
    """This task's HetContext (from os.environ unless `env` is given)."""
    env = os.environ if env is None else env
    comps = components_from_env(env)
    group = int(env.get(GROUP_ENV, "0"))
    return HetContext(
        leader_job_id=comps[0].job_id, group=group,
        rank=int(env.get("SLURM_PROCID", "0")), world=int(env.get("SLURM_STEP_NUM_TASKS", comps[group].ntasks)),
        local_rank=int(env.get("SLURM_LOCALID", "0")), node=env.get("SLURMD_NODENAME", ""),
        restart_count=int(env.get("SLURM_RESTART_COUNT", "0")), components=comps)


class ComponentStep:
    """The `srun --het-group=N` step that runs one component's tasks; `stop()` ends it."""

    def __init__(self, group: int, argv: tp.Sequence[str], proc: subprocess.Popen, job_id: str | None = None) -> None:
        self.group, self.argv, self.proc = group, tuple(argv), proc
        self.job_id = job_id
        """SLURM's job id of this component (the leader's + group); None: stop() signals srun only."""

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int:
        """Wait up to timeout_s for the step to end; its srun exit code."""
        log.info("waiting up to %.0f s for het group %d step %s", timeout_s, self.group, shlex.join(self.argv))
        return self.proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM to every task of the component, through SLURM; SIGTERM to srun after timeout_s, then
        SIGKILL.

        Not srun's own SIGTERM first: srun answers it with "forcing job termination", a SIGKILL of its
        tasks, so an engine never gets to finish its requests and exit 0. `scancel -s TERM <component
        job id>` signals that component's steps only (measured on 22.05: component 0 gets nothing).
        """
        if self.proc.poll() is None and self.job_id is not None:
            try:
                commands.scancel(self.job_id, signal="TERM")
                return self.proc.wait(timeout=timeout_s)
            except SlurmCommandError as e:  # e.g. the step is not up yet: srun's way below
                log.warning("het group %d: scancel -s TERM %s failed (%s); signalling srun", self.group, self.job_id, e)
            except subprocess.TimeoutExpired:
                log.warning("het group %d tasks still running %.0f s after SIGTERM: stopping srun",
                            self.group, timeout_s)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("het group %d step ignored SIGTERM for %.0f s: SIGKILL", self.group, timeout_s)
                self.proc.kill()
        return self.proc.wait(timeout=timeout_s)


def launch_component(group: int, argv: tp.Sequence[str], *, env: tp.Mapping[str, str] | None = None,
                     output: str | Path | None = None, srun_args: tp.Sequence[str] = ()) -> ComponentStep:
    """Start every task of component `group` with one `srun --het-group=N` (from inside the het job).

    `output` is srun's --output pattern (default: stdout/stderr of this process); `env` adds variables.
    """
    if group < 1:
        raise RlslurmError("launch_component starts components >= 1; component 0 runs the submitted function")
    comps = components_from_env(os.environ)
    if group >= len(comps):
        raise RlslurmError(f"het job {comps[0].job_id} has {len(comps)} components; no component {group}")
    full_env = {**os.environ, **(env or {}), GROUP_ENV: str(group)}
    log.info("het group %d (%s, %s): %s", group, comps[group].partition, comps[group].nodelist, shlex.join(argv))
    proc = commands.srun_het_group(group, argv, env=full_env, output=None if output is None else str(output),
                                   srun_args=srun_args)
    return ComponentStep(group, argv, proc, job_id=comps[group].job_id)


TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch" / "hetjob.sbatch.template"


def render_template(template: str | Path = TEMPLATE, **values: str | int | tp.Sequence[str]) -> str:
    """Fill the `{{name}}` fields of an sbatch template; strings are shell-quoted, sequences are argv
    (joined with quoting). Every field must be given and every value used."""
    text = Path(template).read_text()
    wanted = set(re.findall(r"\{\{(\w+)\}\}", text))
    if wanted != set(values):
        raise RlslurmError(f"{template}: missing fields {sorted(wanted - set(values))}, "
                           f"unknown fields {sorted(set(values) - wanted)}")

    def quote(v: str | int | tp.Sequence[str]) -> str:
        if isinstance(v, int):
            return str(v)
        return shlex.quote(v) if isinstance(v, str) else shlex.join(v)

    return re.sub(r"\{\{(\w+)\}\}", lambda m: quote(values[m.group(1)]), text)

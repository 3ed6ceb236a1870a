"""One run directory per job: the single source of truth that status, diag, resume and humans read.

    <run>/config.yaml        resolved config (defaults filled in); config.submitted.yaml: the file as given
    <run>/plan.json          the plan at submit time
    <run>/layout.json        what the plan decided: placement, sync method, nodes, engines (rlslurm/layout.py)
    <run>/jobs.jsonl         one line per start of the job: SLURM job id, restart count, host, time
    <run>/events.jsonl       append-only events (rlslurm/events.py)
    <run>/metrics.jsonl      per-step metrics
    <run>/heartbeats/        <role>-<rank>.json, rewritten in place by each process
    <run>/env/               <role>-<rank>.json env fingerprints
    <run>/stacks/            stack dumps written on hangs and by diag
    <run>/checkpoints/       step-XXXXXXXX/ complete checkpoints, `latest` pointer
    <run>/logs/              SLURM / submitit logs and per-rank logs
    <run>/control/           requests to the running job (e.g. `drain`)
    <run>/endpoints/         where the rollout engines and the reward service publish their URLs
    <run>/export/            hf/: the trained model in Hugging Face layout (SFT and RL); init/: RL's start
    <run>/submissions.jsonl  one line per `rlslurm submit` / `resume`: job id, backend, layout
    <run>/placement.jsonl    one line per task and start: role, rank, node, job ids
    <run>/secret             the job's secret (mode 0600): every server of the job requires it (rlslurm/secret.py)

Processes find it from the RLSLURM_RUN_DIR environment variable that submit sets. Commands that take
`<jobid|rundir>` (status, drain, resume, diag, envdiff, report) find it with `find_run`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from rlslurm.errors import RunDirError

log = logging.getLogger(__name__)

ENV_VAR = "RLSLURM_RUN_DIR"
SUBDIRS = ("heartbeats", "env", "stacks", "checkpoints", "logs", "control")


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory; `create()` makes the folders."""

    path: Path

    @classmethod
    def from_env(cls) -> "RunDir":
        value = os.environ.get(ENV_VAR)
        if not value:
            raise RunDirError(f"{ENV_VAR} is not set: this process was not started by rlslurm submit")
        return cls(Path(value))

    def create(self) -> "RunDir":
        for sub in SUBDIRS:
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        return self

    def exists(self) -> bool:
        return (self.path / "config.yaml").is_file()

    config = property(lambda self: self.path / "config.yaml")
    plan = property(lambda self: self.path / "plan.json")
    layout = property(lambda self: self.path / "layout.json")
    jobs = property(lambda self: self.path / "jobs.jsonl")
    events = property(lambda self: self.path / "events.jsonl")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    heartbeats = property(lambda self: self.path / "heartbeats")
    env = property(lambda self: self.path / "env")
    stacks = property(lambda self: self.path / "stacks")
    checkpoints = property(lambda self: self.path / "checkpoints")
    logs = property(lambda self: self.path / "logs")
    control = property(lambda self: self.path / "control")
    secret = property(lambda self: self.path / "secret")

    def append_json(self, path: Path, record: dict) -> None:
        """Append one JSON line whole, or nothing (see `append_line`)."""
        append_line(path, (json.dumps(record, default=str, sort_keys=False) + "\n").encode())

    def record_start(self, **fields) -> None:
        """Add a line to jobs.jsonl for this start of the job (job id, restart count, ...)."""
        self.append_json(self.jobs, {"t": time.time(), **fields})


TORN_TAIL_MAX_BYTES = 1 << 20
"""How far back from a file's end a torn last line is looked for (a JSON line of the run is far shorter)."""


def append_line(path: Path, line: bytes) -> None:
    """Append one complete line (ending in a newline) to a JSON-lines file, whole or not at all.

    One write(2) on an O_APPEND fd, under an exclusive flock that every writer of the run's JSON lines takes
    (appends from the ranks, the supervisor, the engines' supervisors and the CLI never interleave). A full
    disk (ENOSPC) or a quota can make that write short: the part written is cut off again before the error
    is raised, so the file never ends in half a line that the next append would run on from (issue 38: a
    resume's `submitted` event appended onto a torn metrics row made both unreadable). A torn tail left by a
    writer killed mid-write is cut off by the next append the same way, and said in this process's log.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        size = _cut_torn_tail(path, fd, size)
        try:
            written = os.write(fd, line)
        except OSError:
            written = None
            _truncate_back(fd, size)
            raise
        if written != len(line):
            _truncate_back(fd, size)
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: only {written} of {len(line)} bytes of a "
                                        f"line could be appended; the part written was cut off again", str(path))
    finally:
        os.close(fd)  # releases the flock


def _truncate_back(fd: int, size: int) -> None:
    """Take back what a failed append wrote past `size` (best effort: the disk that failed may fail this)."""
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        log.warning("could not cut a partly written line off (%s): readers skip it", e)


def _cut_torn_tail(path: Path, fd: int, size: int) -> int:
    """If the file (under our flock) does not end in a newline, cut it back to its last one; the new size."""
    if size == 0:
        return 0
    with open(path, "rb") as f:
        start = max(0, size - TORN_TAIL_MAX_BYTES)
        f.seek(start)
        tail = f.read(size - start)
    if tail.endswith(b"\n"):
        return size
    keep = start + tail.rfind(b"\n") + 1 if b"\n" in tail else (0 if start == 0 else size)
    if keep == size:  # no newline in the last MiB: not a torn JSON line of ours; append after it on a new line
        os.write(fd, b"\n")
        return size + 1
    log.warning("%s ended in %d bytes of a torn line (a writer stopped mid-write): cut off before appending",
                path, size - keep)
    os.ftruncate(fd, keep)
    return keep


def read_jsonl(path: Path) -> list[dict]:
    """All complete JSON lines of a file; a torn last line (a writer killed mid-write) is ignored."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


RENAMED_METRICS = {"heldout_accuracy": "held_out_accuracy", "heldout_correct": "held_out_correct",
                   "heldout_total": "held_out_total", "heldout_loss": "held_out_loss", "heldout_rows": "held_out_rows",
                   "heldout_tokens": "held_out_tokens"}
"""Old spelling -> the one name of a metric (docs/metrics.md): runs before issue 39 wrote SFT's held-out result
as `heldout_*` and RL's as `held_out_*`. Every reader takes a metrics line through `current_names`."""


def current_names(record: dict) -> dict:
    """A metrics.jsonl line with each key of RENAMED_METRICS under its current name (old runs still read)."""
    if not any(key in record for key in RENAMED_METRICS):
        return record
    return {RENAMED_METRICS.get(key, key): value for key, value in record.items()}


class JsonlTail:
    """The records appended to a JSON-lines file since the last `read()` (a line still being written is
    kept for the next); `from_end` skips what the file holds already."""

    def __init__(self, path: str | Path, *, from_end: bool = False):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if from_end and self.path.is_file() else 0
        self.partial = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # empty, or torn by a writer killed mid-line: the record is lost, not the run
        return out


JOB_RECORDS = ("submissions.jsonl", "jobs.jsonl", "placement.jsonl")
"""Where a run records SLURM job ids: each submission (before any start, so a job that never ran is found),
each start of the job (across requeues and resumes), each task's placement (a het component's own id)."""
DEFAULT_RUN_ROOTS = ("runs", ".")
"""Where `find_run` looks without --run-root: `cluster.run_root`'s default, then the current directory."""
_JOB_ID = re.compile(r"(\d+)(?:\+\d+)?")


class FoundRun(NamedTuple):
    """What a `<jobid|rundir>` argument names."""

    run: RunDir
    job_id: str | None
    """The job's id as SLURM answers for all its components (a het job's leader); None: never had one."""


def find_run(target: str | Path, run_root: str | Path | None = None) -> FoundRun:
    """The run that a `<jobid|rundir>` argument names; every command that takes one asks here.

    In order:
    - a path to a run directory (it holds config.yaml or one of the run's records): that run, with the
      job id of its newest submission or start;
    - a SLURM job id recorded in `<root>/*/{submissions,jobs,placement}.jsonl`: the run whose newest record
      has it (an id stays with its run across requeues; should a fresh cluster reuse one, the newest run
      wins). A het component is found by `12+1` (squeue's and sacct's spelling) or by its own id (13);
      the job id returned is then the leader's (12), the one SLURM requeues and reports the whole job by;
    - a run directory's name under a root (`tiny-grpo-20260101-120000`).
    Roots: `run_root`, else ./runs then the current directory. Anything else raises RunDirError naming
    what it looked at.
    """
    text = str(target).strip()
    path = Path(text)
    if path.is_dir():
        if _is_run(path):
            run = RunDir(path)
            return FoundRun(run, newest_job_id(run))
        inside = sorted((p.name for p in path.iterdir() if _is_run(p)), reverse=True)
        hint = f"; runs in it: {', '.join(inside[:5])}{' ...' if len(inside) > 5 else ''}" if inside else ""
        raise RunDirError(f"{text} is a directory but not a run directory (none of config.yaml, events.jsonl, "
                          f"{', '.join(JOB_RECORDS)} in it){hint}")
    roots = [Path(run_root)] if run_root else [Path(r) for r in DEFAULT_RUN_ROOTS]
    job = _JOB_ID.fullmatch(text)
    looked = []
    for root in roots:
        runs = sorted(p for p in root.iterdir() if _is_run(p)) if root.is_dir() else []
        looked.append(f"{root.resolve()} ({len(runs)} run director{'y' if len(runs) == 1 else 'ies'})")
        if job:
            found = _recorded(runs, text, job.group(1))
            if found:  # the first root that knows the job decides: `.` is only the fallback
                return found
        elif _is_run(root / text):
            run = RunDir(root / text)
            return FoundRun(run, newest_job_id(run))
    what = f"no run records job {text}" if job else f"{text!r} is no directory, job id or run name"
    raise RunDirError(f"{what}: looked in {'; '.join(looked)}"
                      + (f" for */{{{','.join(JOB_RECORDS)}}}" if job else "")
                      + "; pass --run-root DIR (the job's cluster.run_root) or the run directory itself")


def _recorded(runs: list[Path], job_id: str, leader: str) -> FoundRun | None:
    """The run among `runs` whose newest record carries `job_id` (or its het leader), with the leader's id."""
    best: tuple[float, Path, str] | None = None
    for path in runs:
        for name in JOB_RECORDS:
            for record in read_jsonl(path / name):
                ids = {str(record[k]) for k in ("job_id", "slurm_job_id") if record.get(k) is not None}
                if (job_id in ids or leader in ids) and (best is None or record.get("t", 0.0) >= best[0]):
                    best = (record.get("t", 0.0), path, str(record.get("job_id") or leader))
    return FoundRun(RunDir(best[1]), best[2]) if best else None


def newest_job_id(run: RunDir) -> str | None:
    """The job id of the run's newest submission or start (a het job's leader); None for a run without one."""
    records = [r for name in JOB_RECORDS[:2] for r in read_jsonl(run.path / name) if r.get("job_id")]
    if not records:
        return None
    newest = max(range(len(records)), key=lambda i: (records[i].get("t", 0.0), i))
    return str(records[newest]["job_id"])


def submitted_backend(run: RunDir) -> str | None:
    """Where the run's newest submission went (`slurm` or `local`); None for a run never submitted.
    A local run's job id is submitit's local one, which SLURM knows nothing of."""
    subs = read_jsonl(run.path / "submissions.jsonl")
    return subs[-1].get("backend") if subs else None


def _is_run(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in ("config.yaml", "events.jsonl", *JOB_RECORDS))

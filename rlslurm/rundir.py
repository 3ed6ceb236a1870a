"""One run directory per job: the single source of truth that status, diag, resume and humans read.

    <run>/config.yaml        resolved config (defaults filled in)
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
    <run>/secret             the job's secret (mode 0600): every server of the job requires it (rlslurm/secret.py)

Processes find it from the RLSLURM_RUN_DIR environment variable that submit sets.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from rlslurm.errors import RunDirError

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
        """Append one JSON line with a single write(2) on an O_APPEND fd: concurrent writers never interleave."""
        line = (json.dumps(record, default=str, sort_keys=False) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def record_start(self, **fields) -> None:
        """Add a line to jobs.jsonl for this start of the job (job id, restart count, ...)."""
        self.append_json(self.jobs, {"t": time.time(), **fields})


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

"""The append-only events log of a run: phase changes, hang detected, drain, requeue, resume, sync
verified / failed, reward degraded, checkpoint skipped, ...

    emit(run, "resume", step=12, checkpoint="step-00000012")

Each event is one JSON line {"t", "kind", "host", "pid", "role", "rank", ...fields}; `role` and `rank`
come from RLSLURM_ROLE / RLSLURM_RANK when not given.
"""

from __future__ import annotations

import os
import time

from rlslurm.node import node_name
from rlslurm.rundir import RunDir, read_jsonl


def emit(run: RunDir, kind: str, **fields) -> dict:
    """Append one event to `run`'s events.jsonl and return it."""
    record = {
        "t": time.time(),
        "kind": kind,
        "host": node_name(),
        "pid": os.getpid(),
        "role": fields.pop("role", os.environ.get("RLSLURM_ROLE", "main")),
        "rank": fields.pop("rank", int(os.environ.get("RLSLURM_RANK", "0"))),
        **fields,
    }
    run.append_json(run.events, record)
    return record


def read_events(run: RunDir, kind: str | None = None) -> list[dict]:
    """Events of `run` in order, optionally only those of one kind."""
    events = read_jsonl(run.events)
    return [e for e in events if kind is None or e.get("kind") == kind]

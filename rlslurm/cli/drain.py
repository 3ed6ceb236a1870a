"""`rlslurm drain <jobid|rundir>`: ask a running job to stop taking work, checkpoint and leave.

    rlslurm drain runs/rl-demo --reason "node maintenance"

Writes <run>/control/drain; every process's drain gate notices it at its next phase boundary, and the
job checkpoints, requeues itself and removes the file. The request is for the processes running now: a
start that begins after it (a job still pending after a requeue) ignores it as stale (diag/drain_gate.py).
"""

from __future__ import annotations

import click

from rlslurm.cli.options import run_root_option
from rlslurm.diag.drain_gate import request_drain
from rlslurm.events import DRAIN_REQUESTED, emit
from rlslurm.rundir import find_run


@click.command("drain")
@click.argument("target")
@click.option("--reason", default="requested by rlslurm drain", show_default=True, help="Why (kept in the events).")
@run_root_option
def command(target: str, reason: str, run_root: str | None) -> None:
    """Request a drain of TARGET (a run directory or SLURM job id)."""
    run, job_id = find_run(target, run_root)
    path = request_drain(run, reason)
    emit(run, DRAIN_REQUESTED, role="cli", rank=None, reason=reason, job_id=job_id, file=str(path))
    click.echo(f"drain requested: {path} ({reason})")

"""`rlslurm status <jobid|rundir>`: SLURM state per component, step and phase per role, last checkpoint."""

from __future__ import annotations

import dataclasses
import json

import click


@click.command("status")
@click.argument("target")
@click.option("--run-root", type=click.Path(file_okay=False), help="Where run directories live (for a job id).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def command(target: str, run_root: str | None, as_json: bool) -> None:
    """Show the state of TARGET (a SLURM job id or a run directory)."""
    from rlslurm.status import collect, render

    status = collect(target, run_root)
    click.echo(json.dumps(dataclasses.asdict(status), default=str, indent=2) if as_json else render(status), nl=False)

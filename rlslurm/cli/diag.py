"""`rlslurm diag <jobid|rundir>`: one redacted .tar.gz with everything about a run, and the likely cause.

    rlslurm diag runs/rl-demo            # a run directory
    rlslurm diag 1234 --run-root runs    # a SLURM job id (or 1234+1) recorded by a run under runs/
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from rlslurm.cli.options import run_root_option
from rlslurm.diag.bundle import collect


@click.command("diag")
@click.argument("target")
@run_root_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Directory for the .tar.gz.")
@click.option("--no-live", is_flag=True, help="Do not py-spy processes of the run still running on this host.")
@click.option("--no-slurm", is_flag=True, help="Do not ask SLURM (scontrol, sacct) about the job.")
@click.option("--log-lines", type=int, default=200, show_default=True, help="Lines kept of each log.")
@click.option("--json", "as_json", is_flag=True, help="Print the causes as JSON instead of text.")
def command(target: str, run_root: str | None, out_dir: str, no_live: bool, no_slurm: bool, log_lines: int,
            as_json: bool) -> None:
    """Collect TARGET (a run directory or SLURM job id) into a diag bundle and say why it died or hung."""
    bundle = collect(target, run_root=Path(run_root) if run_root else None, out_dir=Path(out_dir),
                     live=not no_live, slurm=not no_slurm, log_tail_lines=log_lines)
    if as_json:
        click.echo(json.dumps({"bundle": str(bundle.path), "causes": [c.__dict__ for c in bundle.causes]},
                              indent=1))
    else:
        click.echo(bundle.summary, nl=False)

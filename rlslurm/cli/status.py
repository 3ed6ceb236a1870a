"""`rlslurm status <jobid|rundir> [--follow]`: SLURM state per component, step and phase per role, progress."""

from __future__ import annotations

import dataclasses
import json

import click

from rlslurm.cli.options import run_root_option


@click.command("status")
@click.argument("target")
@run_root_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--follow", is_flag=True, help="Then show the progress line until the job ends (through requeues); "
                                             "exit non-zero unless it finished.")
def command(target: str, run_root: str | None, as_json: bool, follow: bool) -> None:
    """Show the state of TARGET (a SLURM job id or a run directory)."""
    from rlslurm.status import collect, render

    status = collect(target, run_root)
    click.echo(json.dumps(dataclasses.asdict(status), default=str, indent=2) if as_json else render(status), nl=False)
    if follow:
        from rlslurm.progress import LinePrinter
        from rlslurm.status import follow as follow_run

        printer = LinePrinter(click.get_text_stream("stdout"))
        try:
            ended = follow_run(target, run_root, printer.show)
            printer.show(None, final=True)
        finally:
            printer.close()
        click.echo(f"ended: {ended}")

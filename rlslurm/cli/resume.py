"""`rlslurm resume <jobid|rundir>`: submit a stopped run again; it goes on from its newest complete checkpoint."""

from __future__ import annotations

import click

from rlslurm.cli.options import run_root_option
from rlslurm.cli.submit import follow_submission


@click.command("resume")
@click.argument("target")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Change a config key for the rest of the run, e.g. train.steps=120 to train on.")
@click.option("--force", is_flag=True, help="Submit although the plan's pre-flight refuses.")
@click.option("--backend", type=click.Choice(["slurm", "local"]), help="Default: the run's last submission's.")
@run_root_option
@click.option("--wait", is_flag=True,
              help="Block until the job ends, showing its progress line; exit non-zero if it failed.")
def command(target: str, overrides: tuple[str, ...], force: bool, backend: str | None, run_root: str | None,
            wait: bool) -> None:
    """Submit the run TARGET (a run directory or a job id) again, into its own run directory.

    For a run that stopped for good: finished (then --set train.steps=N trains on), drained or failed off
    SLURM, cancelled, or stopped for lack of progress. Refused while a job of the run is alive."""
    from rlslurm import launch
    from rlslurm.config import load_config
    from rlslurm.rundir import RunDir

    sub = launch.resume(target, overrides=overrides, force=force, backend=backend, run_root=run_root)
    click.echo(launch.describe(sub))
    if wait:
        follow_submission(sub, load_config(RunDir(sub.run_dir).config).train.steps)

"""`rlslurm submit config.yaml`: validate, pre-flight, run directory, then a SLURM het job or a local run."""

from __future__ import annotations

from pathlib import Path

import click

from rlslurm.config import load_config


@click.command("submit")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. train.steps=50.")
@click.option("--force", is_flag=True, help="Submit although the plan's pre-flight refuses (OOM, divisibility).")
@click.option("--backend", type=click.Choice(["slurm", "local"]), help="Override cluster.backend.")
@click.option("--run-root", type=click.Path(file_okay=False), help="Override cluster.run_root.")
@click.option("--wait", is_flag=True,
              help="Block until the job ends, showing its progress line; exit non-zero if it failed.")
@click.option("--dry-run", is_flag=True,
              help="Validate and pre-flight, then print the sbatch script (or the local launch); submit nothing.")
def command(config: str, overrides: tuple[str, ...], force: bool, backend: str | None, run_root: str | None, wait: bool,
            dry_run: bool) -> None:
    """Submit the job described by CONFIG and print its id and run directory."""
    from rlslurm import launch

    if dry_run and wait:
        raise click.UsageError("--dry-run submits nothing, so there is nothing to --wait for")
    from rlslurm.data.check import check_data

    job = load_config(config, overrides)
    check_data(job)  # a bad data file is refused here, before a run directory exists
    if dry_run:
        click.echo(launch.dry_run(job, force=force, backend=backend, run_root=run_root), nl=False)
        return
    sub = launch.submit(job, config_text=Path(config).read_text(), force=force, backend=backend, run_root=run_root)
    click.echo(launch.describe(sub))
    if wait:
        follow_submission(sub, job.train.steps)


def follow_submission(sub, total_steps: int) -> None:
    """--wait: the progress line until the job ends; raises JobFailedError if it failed or did not finish."""
    from rlslurm import launch
    from rlslurm.progress import LinePrinter, Progress
    from rlslurm.rundir import RunDir

    progress = Progress(RunDir(sub.run_dir), total_steps=total_steps)
    printer = LinePrinter(click.get_text_stream("stdout"))
    try:
        results = launch.wait(sub, on_poll=lambda: printer.show(progress.poll()))
        printer.show(progress.poll(), final=True)
    finally:
        printer.close()
    click.echo(f"job {sub.job_id} ended: {results}")
    launch.check_results(sub, results)

"""`rlslurm report <jobid|rundir>`: plots and a self-contained HTML page of a run's per-step metrics.

    rlslurm report runs/tiny-grpo-20261201-004207          # -> <run>/report/report.png, report.html
    rlslurm report 1234 --run-root runs --out /tmp/rep     # a job id recorded by submit; another folder
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from rlslurm.cli.options import run_root_option


@click.command("report")
@click.argument("target")
@run_root_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for report.png and report.html (default: <run>/report).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and the files written as JSON.")
def command(target: str, run_root: str | None, out_dir: str | None, as_json: bool) -> None:
    """Plot TARGET's (a run directory or SLURM job id) per-step metrics into a PNG and an HTML page."""
    from rlslurm.report import summary, write
    from rlslurm.rundir import find_run

    run, _ = find_run(target, run_root)
    files = write(run, Path(out_dir) if out_dir else None)
    numbers = summary(files.data)
    if as_json:
        click.echo(json.dumps({"png": str(files.png), "html": str(files.html), "summary": numbers,
                               "missing": files.data.missing}, indent=1, default=str))
        return
    width = max(len(k) for k in numbers)
    for key, value in numbers.items():
        click.echo(f"{key:<{width}}  {value}")
    for line in files.data.missing:
        click.echo(f"missing: {line}")
    click.echo(f"wrote {files.png}\nwrote {files.html}")

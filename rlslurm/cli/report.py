"""`rlslurm report <jobid|rundir>`: plots and a self-contained HTML page of a run's per-step metrics.

    rlslurm report runs/tiny-grpo-20261201-004207          # -> <run>/report/report.png, report.html
    rlslurm report 1234 --run-root runs --out /tmp/rep     # a job id recorded by submit; another folder
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from rlslurm.cli.options import run_root_option


def _versus_line(row: dict) -> str:
    def show(value):
        return "-" if value is None else f"{value:.4g}"

    ratio = "" if row["ratio"] is None else f"  x{row['ratio']:.2f}"
    return f"{row['figure']:<24} planned {show(row['planned']):>9}  measured {show(row['measured']):>9}{ratio}"


@click.command("report")
@click.argument("target")
@run_root_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for report.png and report.html (default: <run>/report).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and the files written as JSON.")
def command(target: str, run_root: str | None, out_dir: str | None, as_json: bool) -> None:
    """Plot TARGET's (a run directory or SLURM job id) per-step metrics into a PNG and an HTML page."""
    from rlslurm.plan_vs_run import plan_vs_measured
    from rlslurm.report import summary, write
    from rlslurm.rundir import find_run

    run, _ = find_run(target, run_root)
    versus = plan_vs_measured(run)
    files = write(run, Path(out_dir) if out_dir else None, versus=versus)
    numbers = summary(files.data)
    if as_json:
        click.echo(json.dumps({"png": str(files.png), "html": str(files.html), "summary": numbers,
                               "missing": files.data.missing,
                               "plan_vs_measured": versus["rows"] if versus else [],
                               "trainer_peak_gb_by_rank": versus["trainer_peak_gb_by_rank"] if versus else None},
                              indent=1, default=str))
        return
    width = max(len(k) for k in numbers)
    for key, value in numbers.items():
        click.echo(f"{key:<{width}}  {value}")
    for row in (versus or {}).get("rows", []):
        click.echo(f"plan vs measured: {_versus_line(row)}")
    for line in files.data.missing:
        click.echo(f"missing: {line}")
    click.echo(f"wrote {files.png}\nwrote {files.html}")

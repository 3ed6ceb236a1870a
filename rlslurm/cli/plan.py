"""`rlslurm plan config.yaml`: the arithmetic before the GPUs (see rlslurm/plan/report.py).

Exit codes: 0 the plan's pre-flight accepts the job; 3 (PreflightError) it refuses, after printing the
whole plan (text or --json) with every reason; 2 the config does not load.
"""

from __future__ import annotations

import click

from rlslurm.config import load_config
from rlslurm.errors import PreflightError


@click.command("plan")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. train.steps=50.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--explain", is_flag=True, help="Show the terms behind each number.")
def command(config: str, overrides: tuple[str, ...], as_json: bool, explain: bool) -> None:
    """Per-GPU memory per split, divisibility, placement, sync, roofline, step time, checkpoint interval."""
    from rlslurm.data.check import check_data
    from rlslurm.plan.report import build_plan, preflight, render_json, render_text

    job = load_config(config, overrides)
    check_data(job)  # the verdict of validate and submit: a job they refuse for its data is not planned
    plan = build_plan(job)
    click.echo(render_json(plan) if as_json else render_text(plan, explain=explain), nl=False)
    problems = preflight(plan)
    if problems:
        where = "preflight_problems" if as_json else "the `preflight: REFUSE` lines"
        raise PreflightError(f"{config}: the pre-flight refuses this job ({len(problems)} problem(s), listed in "
                             f"{where} above); rlslurm submit would refuse it too")

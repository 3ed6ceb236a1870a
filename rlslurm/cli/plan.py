"""`rlslurm plan config.yaml`: the arithmetic before the GPUs (see rlslurm/plan/report.py).

Exit codes: 0 the plan's pre-flight accepts the job; 3 (PreflightError) it refuses, after printing the
whole plan (text or --json) with every reason; 2 the config does not load.

    rlslurm plan big.yaml --from-run runs/small-...   # each term a run measured, as measured / planned, scales
                                                        # the same term here (rlslurm/plan/calibration.py)
"""

from __future__ import annotations

import click

from rlslurm.cli.options import run_root_option
from rlslurm.config import load_config
from rlslurm.errors import PreflightError, RunDirError


@click.command("plan")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. train.steps=50.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--explain", is_flag=True, help="Show the terms behind each number.")
@click.option("--from-run", "from_run", metavar="RUN", default=None,
              help="Calibrate every term a run measured (its directory or job id): run small first, then plan big.")
@run_root_option
def command(config: str, overrides: tuple[str, ...], as_json: bool, explain: bool, from_run: str | None,
            run_root: str | None) -> None:
    """Per-GPU memory per split, divisibility, placement, sync, roofline, step time, checkpoint interval."""
    from rlslurm.data.check import check_data
    from rlslurm.plan.render import render_json, render_text
    from rlslurm.plan.report import build_plan, preflight

    job = load_config(config, overrides)
    check_data(job)  # the verdict of validate and submit: a job they refuse for its data is not planned
    calibration = None
    if from_run is not None:
        from rlslurm.plan_vs_run import calibration as measured_constants
        from rlslurm.rundir import find_run

        run, _ = find_run(from_run, run_root)
        if not run.plan.is_file():
            raise RunDirError(f"{run.path} holds no plan.json: --from-run needs a run rlslurm submit started")
        calibration = measured_constants(run)
    plan = build_plan(job, calibration=calibration)
    click.echo(render_json(plan) if as_json else render_text(plan, explain=explain), nl=False)
    problems = preflight(plan)
    if problems:
        where = "preflight_problems" if as_json else "the `preflight: REFUSE` lines"
        raise PreflightError(f"{config}: the pre-flight refuses this job ({len(problems)} problem(s), listed in "
                             f"{where} above); rlslurm submit would refuse it too")

"""`rlslurm plan config.yaml`: the arithmetic before the GPUs (see rlslurm/plan/report.py)."""

from __future__ import annotations

import click

from rlslurm.config import load_config


@click.command("plan")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key, e.g. train.steps=50.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--explain", is_flag=True, help="Show the terms behind each number.")
def command(config: str, overrides: tuple[str, ...], as_json: bool, explain: bool) -> None:
    """Per-GPU memory per split, divisibility, placement, sync, roofline, step time, checkpoint interval."""
    from rlslurm.plan.report import build_plan, render_json, render_text

    plan = build_plan(load_config(config, overrides))
    click.echo(render_json(plan) if as_json else render_text(plan, explain=explain), nl=False)

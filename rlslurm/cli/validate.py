"""`rlslurm validate config.yaml`: load and check a job config; print the resolved config with --print."""

from __future__ import annotations

import click
import yaml

from rlslurm.config import load_config
from rlslurm.configfile import to_dict


@click.command("validate")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. train.steps=50.")
@click.option("--print", "show", is_flag=True, help="Print the resolved config (defaults filled in) as YAML.")
def command(config: str, overrides: tuple[str, ...], show: bool) -> None:
    """Check CONFIG: syntax, keys, types, values and the rules between sections; the data files it names
    (a bounded sample of their rows: columns, types, lengths); reward.function, imported."""
    from rlslurm.data.check import check_data

    job = load_config(config, overrides)
    lines = check_data(job)
    if job.reward.function is not None and job.reward.scorer == "function":
        from rlslurm.reward.function import load_function

        # Imported here, as the service's workers will import it: an error at import is a ConfigError now,
        # not an unscored step later.
        _, name = load_function(job.reward.function)
        lines.append(f"reward.function = {job.reward.function}: {name} imports and takes "
                     "(data_source, solution_str, ground_truth, extra_info=None)")
    if show:
        click.echo(yaml.safe_dump(to_dict(job), sort_keys=False), nl=False)
    else:
        for line in lines:
            click.echo(line)
        click.echo(f"{config}: ok ({job.job.kind} job {job.job.name!r})")

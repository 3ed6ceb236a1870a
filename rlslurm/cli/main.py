"""The `rlslurm` command: one click group, one module per subcommand.

    rlslurm --help
    rlslurm init --partition-train gpu --gpu-profile h100-80g --nodes 2 --gpus-per-node 8 -o job.yaml
    rlslurm validate examples/lecture-h20.yaml
    rlslurm plan examples/lecture-h20.yaml [--json] [--explain]
    rlslurm submit examples/tiny-grpo.yaml [--backend local|slurm] [--wait] [--dry-run]
    rlslurm resume <jobid|rundir> [--set train.steps=120] [--wait]
    rlslurm status <jobid|rundir>      rlslurm drain <jobid|rundir>
    rlslurm diag <jobid|rundir>        rlslurm envdiff A [B]
    rlslurm report <jobid|rundir>
    rlslurm score examples/score-humaneval.yaml --responses FILE.jsonl [--split eval|train] [--show N]

Every RlslurmError becomes one message on stderr and its class's exit code; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import sys

import click

from rlslurm import __version__
from rlslurm.errors import RlslurmError


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RlslurmError as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.secho(f"rlslurm: error: {e}", fg="red", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rlslurm")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Plan, submit, watch, resume and diagnose SFT and RL jobs on SLURM."""
    ctx.ensure_object(dict)["debug"] = debug


def _register() -> None:
    # Each subcommand lives in its own module; importing it here keeps `rlslurm --help` complete.
    from rlslurm.cli import diag, drain, envdiff, init, plan, report, resume, score, status, submit, validate

    for module in (init, validate, plan, submit, resume, status, drain, diag, envdiff, report, score):
        cli.add_command(module.command)


_register()


def main() -> None:
    cli(obj={})


if __name__ == "__main__":
    main()

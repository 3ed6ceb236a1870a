"""Options shared by several subcommands: `--run-root` of every command that takes `<jobid|rundir>`.

    @click.command("status")
    @click.argument("target")
    @run_root_option
    def command(target: str, run_root: str | None) -> None:
        run, job_id = find_run(target, run_root)          # rlslurm/rundir.py
"""

from __future__ import annotations

import click

run_root_option = click.option(
    "--run-root", type=click.Path(file_okay=False), default=None,
    help="Where run directories live, to find a job id or a run's name (default: runs/, then the current "
         "directory).")
"""The root `find_run` searches for TARGET when it is not a run directory itself."""

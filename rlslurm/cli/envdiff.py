"""`rlslurm envdiff A [B]`: compare env fingerprints of ranks (files, run directories or job ids).

    rlslurm envdiff runs/rl-demo                                 # all ranks of one run
    rlslurm envdiff runs/a/env/train-0.json runs/b/env/rollout-0.json
    rlslurm envdiff 1234 1240 --run-root runs

A torch or NCCL mismatch that breaks the configured sync is an error (exit 3); other differences are
printed as warnings (exit 0).
"""

from __future__ import annotations

from pathlib import Path

import click

from rlslurm.cli.options import run_root_option
from rlslurm.diag.env_diff import compare, read_fingerprints
from rlslurm.errors import RunDirError
from rlslurm.rundir import find_run


def _fingerprints(source: str, run_root: str | None, prefix: str) -> dict[str, dict]:
    path = Path(source)
    if not path.exists():
        run, _ = find_run(source, run_root)
        path = run.env
    found = read_fingerprints(path, prefix=prefix)
    if not found:
        raise RunDirError(f"{source}: no env fingerprints (expected <run>/env/<role>-<rank>.json)")
    return found


@click.command("envdiff")
@click.argument("a")
@click.argument("b", required=False)
@click.option("--sync-method", type=click.Choice(["broadcast", "disk", "ipc"]), default="broadcast",
              show_default=True, help="How weights travel train -> rollout (broadcast needs one torch/NCCL).")
@run_root_option
def command(a: str, b: str | None, sync_method: str, run_root: str | None) -> None:
    """Compare the env fingerprints in A (and B): within each role, and train against rollout."""
    fps = _fingerprints(a, run_root, f"{a}:" if b else "")
    if b:
        fps.update(_fingerprints(b, run_root, f"{b}:"))
    diff = compare(fps, sync_method=sync_method)
    click.echo(f"{len(fps)} fingerprints: {', '.join(fps)}")
    click.echo(diff.render(), nl=False)
    diff.raise_errors()

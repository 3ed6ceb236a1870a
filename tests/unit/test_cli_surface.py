"""A snapshot of the CLI surface: new commands and options are deliberate (update SURFACE with them)."""

from __future__ import annotations

import click
from click.testing import CliRunner

from rlslurm import __version__
from rlslurm.cli.main import cli

SURFACE = {
    "diag": ["--json", "--log-lines", "--no-live", "--no-slurm", "--out", "--run-root"],
    "drain": ["--reason", "--run-root"],
    "envdiff": ["--run-root", "--sync-method"],
    "init": ["--account", "--force", "--gpu-profile", "--gpus-per-node", "--kind", "--model-dir", "--name", "--nodes",
             "--out", "--partition-rollout", "--partition-train", "--run-root", "--steps", "--time-limit-min", "-o"],
    "report": ["--json", "--out", "--run-root"],
    "resume": ["--backend", "--force", "--run-root", "--set", "--wait"],
    "plan": ["--explain", "--from-run", "--json", "--run-root", "--set"],
    "score": ["--out", "--pass-at", "--response-key", "--responses", "--set", "--show", "--split"],
    "status": ["--follow", "--json", "--run-root"],
    "submit": ["--backend", "--dry-run", "--force", "--run-root", "--set", "--wait"],
    "validate": ["--print", "--set"],
}


def _surface(group: click.Group) -> dict[str, list[str]]:
    out = {}
    for name, cmd in sorted(group.commands.items()):
        out[name] = sorted(opt for p in cmd.params if isinstance(p, click.Option) for opt in p.opts)
    return out


def test_cli_surface_is_the_snapshot():
    assert _surface(cli) == SURFACE


def test_version_and_help():
    runner = CliRunner()
    assert __version__ in runner.invoke(cli, ["--version"]).output
    help_text = runner.invoke(cli, ["--help"]).output
    for name in SURFACE:
        assert name in help_text

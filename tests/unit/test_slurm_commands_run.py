"""The one SLURM seam's own behaviour on real child processes (no SLURM needed): a command asked to outlive
SIGTERM does, and `requeue` always asks so (a requeue from inside the job SIGTERMs its own scontrol)."""

from __future__ import annotations

import os
import signal
import stat
import sys

import pytest

from rlslurm.errors import SlurmCommandError
from rlslurm.slurm import commands

# The child sends itself SIGTERM, then says it lived.
SELF_TERM = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM); print('lived')"]


def test_a_command_ended_by_sigterm_fails_with_the_signal():
    with pytest.raises(SlurmCommandError, match="exited -15"):
        commands.run(SELF_TERM)


def test_a_command_that_ignores_sigterm_outlives_it_and_reports():
    result = commands.run(SELF_TERM, ignore_sigterm=True)
    assert result.returncode == 0 and result.stdout.strip() == "lived"


def test_requeue_runs_scontrol_so_that_the_requeues_sigterm_cannot_end_it(tmp_path, monkeypatch):
    # A stand-in scontrol on PATH that does what SLURM does to the job's processes on a requeue: SIGTERM.
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!{sys.executable}\nimport os, signal, sys\n"
                        "assert sys.argv[1:] == ['requeue', '40'], sys.argv\n"
                        "os.kill(os.getpid(), signal.SIGTERM)\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert commands.requeue("40") == "scontrol requeue 40"
    # Only the child ignores SIGTERM: the caller's own disposition is untouched.
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN

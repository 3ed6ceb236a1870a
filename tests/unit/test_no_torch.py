"""Processes of a job that need no torch do not import it (issue 36: each torch import is ~250 MB of private
memory per process): `rlslurm submit --wait` (it plans, submits, then only waits), the local supervisor, the node
agent (watchdog) and the reward service. Checked in a fresh interpreter, as each of them starts. (The local
supervisor imports torch and transformers at run time, once, for the ranks it forks: rlslurm/prefork.py; the
submit command no longer imports transformers at all, ~1 s of every `rlslurm submit`.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlslurm.plan.machine import cpu_speed

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
from rlslurm.cli.main import cli
import rlslurm.local_supervisor, rlslurm.diag.watchdog, rlslurm.diag.agent, rlslurm.reward.service
import rlslurm.reward.supervisor, rlslurm.rollout.supervisor
try:
    cli(["submit", "examples/tiny-grpo.yaml", "--dry-run"])    # the config, the data, the plan, the launch
except SystemExit as e:
    assert not e.code, e.code
heavy = sorted(m for m in ("torch", "transformers", "datasets") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_the_submit_command_and_the_supervisors_load_no_torch():
    cpu_speed()  # the plan's speed of this machine, measured (with torch) once and cached, as a first plan does
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout, out.stdout[-2000:]

"""The plan decides once: for every placement and sync method, the layout the job reads from its run
directory is what `rlslurm plan` printed, and the controller builds the transport it names.

Before rlslurm/layout.py, `placement.mode: auto` that the plan turned into colocate was checked with ipc by
the plan and run with broadcast by the job (the controller re-derived placement from the raw YAML).
tests/integration/test_layout_runs.py runs two of these combinations for real.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.errors import PreflightError
from rlslurm.layout import JobLayout
from rlslurm.plan.report import build_plan, render_json
from rlslurm.rundir import RunDir
from rlslurm.sync.protocol import transport_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
COMBINATIONS = list(itertools.product((1, 2), ("auto", "colocate", "separate"), ("auto", "disk", "broadcast", "ipc")))


def _job(nodes: int, mode: str, method: str):
    rollout_nodes = "1" if mode == "separate" and nodes > 1 else "null"
    return load_config(EXAMPLE, (f"hardware.nodes={nodes}", f"placement.mode={mode}",
                                 f"placement.rollout_nodes={rollout_nodes}", f"sync.method={method}"))


@pytest.mark.parametrize("nodes,mode,method", COMBINATIONS, ids=lambda v: str(v))
def test_the_job_runs_what_the_plan_printed(nodes, mode, method, tmp_path):
    job = _job(nodes, mode, method)
    printed = json.loads(render_json(build_plan(job)))
    try:
        run, plan = launch.prepare(job, config_text=EXAMPLE.read_text(), run_root=tmp_path)
    except PreflightError:
        assert printed["preflight_problems"], "submit refused what the plan accepted"
        return
    assert not printed["preflight_problems"]
    JobLayout.decide(job, plan, "local").write(run)  # what launch._launch does before it submits

    layout = JobLayout.read(RunDir(run.path))  # what every process of the job reads
    chosen = printed["chosen"]
    assert (layout.placement, layout.sync_method) == (chosen["placement"], chosen["sync_method"])
    assert layout.rollout_nodes == (chosen["rollout_nodes"] if chosen["placement"] == "separate" else 0)
    assert "auto" not in (layout.placement, layout.sync_method)
    transport = transport_for(layout.sync_method, job.sync, weights_dir=tmp_path / "w")  # rlslurm/rl/controller.py
    try:
        assert transport.name == chosen["sync_method"]
    finally:
        transport.close()


def test_auto_colocated_runs_ipc_as_the_plan_says():
    # The case the issue found: one node, so the plan colocates, and auto sync is then ipc.
    plan = build_plan(_job(1, "auto", "auto"))
    assert (plan.placement, plan.sync_method) == ("colocate", "ipc")
    assert JobLayout.decide(plan.job, plan, "local").sync_method == "ipc"


def test_auto_is_resolved_in_one_place():
    """Only the planner turns `auto` (placement.mode, sync.method) into a decision."""
    pattern = re.compile(r"""(method|mode)\s*[!=]=\s*["']auto["']|\.get\(["'](method|mode)["']""")
    places = []
    for folder in ("rlslurm", "jobs", "diag", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    places.append(f"{path.relative_to(ROOT)}:{n}")
    assert places == ["rlslurm/plan/report.py:85"] or (
        len(places) == 1 and places[0].startswith("rlslurm/plan/report.py:")), places


def test_a_run_without_a_layout_is_refused_with_the_reason(tmp_path):
    from rlslurm.errors import RunDirError

    with pytest.raises(RunDirError, match="layout.json is missing.*rlslurm submit"):
        JobLayout.read(RunDir(tmp_path))

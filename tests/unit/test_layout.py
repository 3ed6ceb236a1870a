"""The plan decides once: for every placement and sync method, the layout the job reads from its run
directory is what `rlslurm plan` printed, and the controller builds the transport it names.

Before rlslurm/layout.py, `placement.mode: auto` that the plan turned into colocate was checked with ipc by
the plan and run with broadcast by the job (the controller re-derived placement from the raw YAML).
tests/integration/test_layout_runs.py runs two of these combinations for real.
"""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path

import pytest

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.errors import ConfigError, PreflightError
from rlslurm.layout import JobLayout
from rlslurm.plan.render import render_json
from rlslurm.plan.report import build_plan
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
    try:
        job = _job(nodes, mode, method)
    except ConfigError as e:  # a combination no layout can run is refused at load, naming both keys
        assert "placement" in str(e) and "sync.method" in str(e), e
        return
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


def _resolvers(path: Path) -> list[str]:
    """Functions of `path` that read `auto` (a `.method` / `.mode` compared with "auto") and return a
    placement or sync method of their own: what resolving `auto` looks like."""
    decided = {"colocate", "separate", "disk", "broadcast", "ipc"}
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        reads_auto = any(isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute)
                         and n.left.attr in ("method", "mode")
                         and any(isinstance(c, ast.Constant) and c.value == "auto" for c in n.comparators)
                         for n in ast.walk(fn))
        returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
        decides = any(isinstance(c, ast.Constant) and c.value in decided for r in returns for c in ast.walk(r.value))
        if reads_auto and decides:
            found.append(f"{path.relative_to(ROOT)}:{fn.name}")
    return found


def test_auto_is_resolved_in_one_place():
    """Only SyncConfig.resolved_method turns sync.method auto into a method (the plan calls it once, at
    submit), and placement.mode auto is chosen by the plan's numbers (plan/report.py `_choose`, through
    plan/placement.py `stated_placement`)."""
    found = [r for folder in ("rlslurm", "jobs", "diag", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
             for r in _resolvers(path)]
    assert found == ["rlslurm/sync/config.py:resolved_method"], found


# Where the raw `placement.mode` / `sync.method` may be read: the planner, the config's own validation, and
# the plan's printout of what the user asked for. Every process of a job reads rlslurm/layout.py instead.
RAW_READERS = {"rlslurm/plan/report.py", "rlslurm/plan/placement.py", "rlslurm/plan/render.py",
               "rlslurm/sync/config.py", "rlslurm/config.py", "rlslurm/config_rules.py"}


def _raw_reads(path: Path) -> list[int]:
    lines = []
    for n in ast.walk(ast.parse(path.read_text())):
        if not isinstance(n, ast.Attribute) or n.attr not in ("mode", "method"):
            continue
        owner = n.value.attr if isinstance(n.value, ast.Attribute) else getattr(n.value, "id", "")
        if (n.attr == "mode" and owner in ("placement", "pl")) or (
                n.attr == "method" and owner in ("sync", "s", "cfg", "config")):
            lines.append(n.lineno)
    return lines


def test_no_process_of_the_job_rederives_the_layout_from_the_yaml():
    found = [f"{path.relative_to(ROOT)}:{line}" for folder in ("rlslurm", "jobs", "diag")
             for path in sorted((ROOT / folder).rglob("*.py")) if str(path.relative_to(ROOT)) not in RAW_READERS
             for line in _raw_reads(path)]
    assert not found, f"the raw placement.mode / sync.method read outside the planner: {found} (read JobLayout)"
    assert _raw_reads(ROOT / "rlslurm/plan/report.py"), "the scan finds no read at all: it would pass vacuously"


def test_a_run_without_a_layout_is_refused_with_the_reason(tmp_path):
    from rlslurm.errors import RunDirError

    with pytest.raises(RunDirError, match="layout.json is missing.*rlslurm submit"):
        JobLayout.read(RunDir(tmp_path))

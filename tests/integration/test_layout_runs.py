"""The plan decides once, seen in real runs: the job syncs with the transport and places its engines the
way `rlslurm plan` printed (tests/unit/test_layout.py checks every combination against the layout file).

The first case is the one that disagreed before rlslurm/layout.py: one node, `placement.mode: auto`, which
the plan colocates, and `sync.method: auto`, which the plan then makes ipc; the job ran broadcast.

    python -m pytest -q -s tests/integration/test_layout_runs.py   # ~40 s on 2 idle cores
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.plan.render import render_json
from rlslurm.plan.report import build_plan
from rlslurm.rundir import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
SMALL = ("train.steps=2", "rl.prompts_per_step=8", "rl.eval_every=100", "task.eval_size=16",
         "checkpoint.interval_steps=1000", "placement.rollout_nodes=null")


@pytest.mark.parametrize("nodes,mode,method,expected", [
    (1, "auto", "auto", ("colocate", "ipc")),
    (2, "separate", "auto", ("separate", "broadcast")),
])
def test_the_job_syncs_and_places_as_the_plan_printed(nodes, mode, method, expected, tmp_path):
    job = load_config(EXAMPLE, SMALL + (f"hardware.nodes={nodes}", f"placement.mode={mode}", f"sync.method={method}"))
    printed = json.loads(render_json(build_plan(job)))["chosen"]
    assert (printed["placement"], printed["sync_method"]) == expected
    sub = launch.submit(job, config_text=EXAMPLE.read_text(), backend="local", run_root=tmp_path)
    results = launch.wait(sub, timeout_s=240, poll_s=0.2)
    assert [int(code) for code in results] == [0] * len(results), f"ended {results}; see {sub.run_dir}"
    synced = [e for e in read_jsonl(sub.run_dir / "events.jsonl") if e["kind"] == "sync_verified"]
    # the first sync (to the starting weights) and one per trained step, all through the printed transport
    assert [e["transport"] for e in synced] == [printed["sync_method"]] * 3
    layout = json.loads((sub.run_dir / "layout.json").read_text())
    assert (layout["placement"], layout["sync_method"]) == expected

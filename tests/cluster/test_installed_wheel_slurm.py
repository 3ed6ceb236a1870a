"""An RL het job on the real local Slurm, submitted by rlslurm installed from its wheel (not editable, a venv of its
own: tests/installed.py) from a directory outside the checkout (issue 39): the trainer on a `train` node and the
engine on a `rollout` node run the installed package, as on a cluster where jobs start from the user's project
directory. The local-backend SFT -> GRPO -> report -> diag of the same install: tests/integration/
test_installed_wheel.py.

    RLSLURM_SLURM_PORT_BASE=21817 python -m pytest -q -s tests/cluster/test_installed_wheel_slurm.py   # ~1 min
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

import spine_util as su
from installed import build_wheel, installed_venv
from rlslurm.rundir import read_jsonl

pytestmark = pytest.mark.cluster

STEPS = 4


def _job(path: Path, init_from: Path) -> Path:
    data = {
        "job": {"name": "installed-rl", "kind": "rl"},
        "hardware": {"profile": "cpu", "nodes": 2, "gpus_per_node": 2},
        "placement": {"mode": "separate", "rollout_nodes": 1},
        "train": {"steps": STEPS, "lr": 3.0e-4, "seed": 0, "init_from": str(init_from)},
        "rl": {"prompts_per_step": 16, "samples_per_prompt": 8, "eval_every": STEPS},
        "rollout": {"engines": 1, "max_new_tokens": 8},
        "task": {"max_operand": 99, "operations": ["+", "-"], "train_size": 4000, "eval_size": 50, "seed": 1234},
        "sync": {"method": "disk"},
        "cluster": {"backend": "slurm", "time_limit_min": 5, "run_root": "runs"},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_het_job_submitted_from_the_installed_wheel_outside_the_checkout(slurm_cluster, sft_export, tmp_path):
    venv = installed_venv(tmp_path / "venv", build_wheel(tmp_path / "whl"))
    elsewhere = tmp_path / "my-project"
    elsewhere.mkdir()
    venv.check(elsewhere)
    config = _job(elsewhere / "job.yaml", sft_export)
    done = venv.run(["rlslurm", "submit", "job.yaml"], cwd=elsewhere)
    assert done.returncode == 0, done.stdout + done.stderr
    (job_id,) = re.findall(r"^submitted slurm job (\S+)$", done.stdout, re.MULTILINE)
    (run,) = re.findall(r"^run directory: (.+)$", done.stdout, re.MULTILINE)
    run = elsewhere / run
    su.TRACKED.append((job_id, run))
    su.wait_done(job_id, run, 240, slurm_cluster.kick)

    assert config.is_file() and run.is_relative_to(elsewhere / "runs")
    (done_event,) = su.events(run, "done")
    assert (done_event["step"], done_event["policy_version"]) == (STEPS, STEPS)
    by_role = {(p["role"], p["rank"]): p for p in su.placements(run, restart=0)}
    assert sorted(by_role) == [("rollout", 0), ("train", 0), ("train", 1)]
    assert by_role["train", 0]["partition"] == "train" and by_role["rollout", 0]["partition"] == "rollout"
    assert {p["job_id"] for p in read_jsonl(run / "submissions.jsonl")} == {job_id}
    # Every process of the job ran the venv's interpreter (its env fingerprint says which), so the installed package.
    fingerprints = {p.stem: json.loads(p.read_text()) for p in (run / "env").glob("*.json")}
    assert {"train-0", "train-1"} <= set(fingerprints), sorted(fingerprints)
    assert {fp["executable"] for fp in fingerprints.values()} == {str(venv.bin / "python")}, fingerprints
    assert su.state(job_id) == "COMPLETED"

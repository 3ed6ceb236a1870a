"""Golden sbatch scripts of the het-job executor and the hand template (tests/golden/*.sbatch).

Each rendered script must match its golden file byte for byte and pass `bash -n`; paths hold a space.
Accept an intended change with:  RLSLURM_UPDATE_GOLDEN=1 python -m pytest -q tests/unit/test_hetjob_golden.py
"""

from __future__ import annotations

import difflib
import os
import subprocess
from pathlib import Path

import pytest

from rlslurm.slurm.hetjob import Component, HetSlurmExecutor, render_template

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
RUN = "/shared/runs/my run"  # the space is the point
ACCEPT = "RLSLURM_UPDATE_GOLDEN=1 python -m pytest -q tests/unit/test_hetjob_golden.py"
COMMAND = f"/opt/venv/bin/python -u -m submitit.core._submit '{RUN}/logs/submitit'"


def _executor(components, **params) -> HetSlurmExecutor:
    ex = HetSlurmExecutor(f"{RUN}/logs/submitit", components=components, python="/opt/venv/bin/python")
    ex.update_parameters(**params)
    return ex


def render_cpu_train_rollout() -> str:
    """The embedded default on the local cluster: 1 train node x 2 ranks, 1 rollout node x 1 engine."""
    ex = _executor([Component(partition="rollout", nodes=1, ntasks_per_node=1)],
                   job_name="rl-tiny", partition="train", nodes=1, ntasks_per_node=2, cpus_per_task=1, time=30,
                   additional_parameters={"requeue": True},
                   setup=[f"export RLSLURM_RUN_DIR='{RUN}'"])
    return ex._make_submission_file_text(COMMAND, "uid")


def render_gpu_three_components() -> str:
    """The lecture's split: 4 train nodes x 8 GPUs, 1 rollout node x 8 GPUs, a CPU reward component."""
    ex = _executor([Component(partition="rollout", nodes=1, ntasks_per_node=8, cpus_per_task=8, mem_gb=900,
                              gres="gpu:8"),
                    Component(partition="cpu", nodes=1, ntasks_per_node=1, cpus_per_task=16, mem_gb=64,
                              extra={"constraint": "highmem"})],
                   job_name="rl-moe", partition="train", nodes=4, ntasks_per_node=8, cpus_per_task=8, gres="gpu:8",
                   mem="900GB", time=240, signal_delay_s=120, account="ml",
                   additional_parameters={"requeue": True, "exclusive": True},
                   setup=[f"export RLSLURM_RUN_DIR='{RUN}'", "export NCCL_DEBUG=WARN"])
    return ex._make_submission_file_text(COMMAND, "uid")


def render_cpu_colocated() -> str:
    """Colocated rollout (placement.mode = colocate): no further component, a plain job of 2 ranks."""
    ex = _executor([], job_name="rl-colocated", partition="train", nodes=1, ntasks_per_node=2, cpus_per_task=1,
                   time=30, additional_parameters={"requeue": True}, setup=[f"export RLSLURM_RUN_DIR='{RUN}'"])
    return ex._make_submission_file_text(COMMAND, "uid")


def render_hand_template() -> str:
    return render_template(job_name="rl by hand", train_partition="train", train_nodes=1, train_tasks_per_node=2,
                           rollout_partition="rollout", rollout_nodes=1, rollout_tasks_per_node=1, time_min=30,
                           signal_before_s=60, run_dir=RUN, log_file=f"{RUN}/logs/slurm-%j.out",
                           train_command=["python", "-m", "rlslurm.jobs.rl", f"{RUN}/config.yaml"],
                           rollout_command=["python", "-m", "rlslurm.rollout.server", "--port", "8000"])


CASES = {"hetjob_cpu_train_rollout": render_cpu_train_rollout,
         "hetjob_cpu_colocated": render_cpu_colocated,
         "hetjob_gpu_three_components": render_gpu_three_components,
         "hetjob_hand_template": render_hand_template}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_sbatch(name, tmp_path):
    text = CASES[name]()
    script = tmp_path / "dir with space" / f"{name}.sbatch"
    script.parent.mkdir()
    script.write_text(text)
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, f"bash -n {script}: {syntax.stderr}"
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("RLSLURM_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    expected = golden.read_text() if golden.exists() else ""
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            str(golden), f"rendered {name}"))
        pytest.fail(f"{golden} differs from the rendered script:\n{diff}\nIf the change is intended: {ACCEPT}")


def test_het_directives_order():
    """sbatch reads component 0's options, then `#SBATCH hetjob`, then component 1's, before any command."""
    lines = render_gpu_three_components().splitlines()
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    hets = [i for i, ln in enumerate(lines) if ln == "#SBATCH hetjob"]
    assert len(hets) == 2 and all(i < first_cmd for i in hets)
    partitions = [ln for ln in lines if ln.startswith("#SBATCH --partition=")]
    assert partitions == ["#SBATCH --partition=train", "#SBATCH --partition=rollout", "#SBATCH --partition=cpu"]
    assert any("--het-group=0" in ln and ln.startswith("srun") for ln in lines)


def test_colocated_job_is_plain():
    """No `#SBATCH hetjob`, no --het-group: SLURM sees one ordinary job on the train partition."""
    text = render_cpu_colocated()
    assert "hetjob" not in text and "--het-group" not in text
    assert "#SBATCH --partition=train" in text and "export RLSLURM_HET_GROUP=0" in text

"""The one step boundary of every training loop (rlslurm/boundary.py), on a real one-rank gloo group: what the ranks
agree (drain, KillWait left, checkpoint due, a loop's own stop), the drain (the loop's hook, the checkpoint, the
control file consumed), the SLURM time limit, and the drain file's one writer (diag/drain_gate.py). The loops' own
drain and resume tests (test_sft_resume, test_toytrain_resume, test_resume, the cluster tier) run it end to end.

    python -m pytest -q tests/unit/test_step_boundary.py      # ~2 s
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from rlslurm.boundary import StepBoundary, slurm_time_limit_s
from rlslurm.checkpoint import CheckpointConfig
from rlslurm.config import JobConfig
from rlslurm.diag.drain_gate import DrainGate, request_drain
from rlslurm.dist import Topology
from rlslurm.events import read_events
from rlslurm.lifecycle import ExitCode
from rlslurm.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_rank(monkeypatch):
    for name in ("SLURM_JOB_ID", "RLSLURM_LEADER_JOB_ID", "SLURM_HET_JOB_ID", "SLURM_JOB_ID_HET_GROUP_0"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield Topology(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0)
    dist.destroy_process_group()


def _boundary(tmp_path, topo, **checkpoint) -> tuple[StepBoundary, RunDir, DrainGate]:
    run = RunDir(tmp_path / "run").create()
    gate = DrainGate(run, poll_interval_s=0.0, not_before=0.0)
    job = JobConfig(checkpoint=CheckpointConfig(**checkpoint))
    return StepBoundary(run, topo, gate, job, start_step=0), run, gate


def test_nothing_asked_goes_on_and_the_checkpoint_interval_and_a_loops_stop_are_agreed(tmp_path, one_rank):
    boundary, _, _ = _boundary(tmp_path, one_rank, interval_steps=5)
    at = boundary.agree(3)
    assert (at.drain, at.time_left_s, at.checkpoint_due, at.stop) == (False, None, False, False)
    assert boundary.agree(5).checkpoint_due and boundary.agree(3, stop=True).stop


def test_a_drain_asked_through_the_control_file_checkpoints_and_consumes_it(tmp_path, one_rank):
    boundary, run, _ = _boundary(tmp_path, one_rank)
    path = request_drain(run, "node maintenance")
    at = boundary.agree(7)
    assert at.drain and at.time_left_s is None
    seen, saved = [], []
    code = boundary.drain(7, at, lambda: saved.append(7) or "step-00000007", before=seen.append)
    assert code == ExitCode.DRAINED and saved == [7] and seen == [None]
    assert not path.exists()  # consumed: the next start runs on
    (drained,) = read_events(run, "drained")
    assert (drained["step"], drained["checkpoint"]) == (7, "step-00000007")
    assert f"control file {path}" in drained["reason"]


def test_a_sigterm_without_time_for_the_checkpoint_relies_on_the_periodic_one(tmp_path, one_rank):
    boundary, run, gate = _boundary(tmp_path, one_rank, cost_s=60.0)
    gate.kill_wait_s = 10.0
    gate._on_signal(signal.SIGTERM, None)  # what the installed handler does on SLURM's SIGTERM
    at = boundary.agree(4)
    assert at.drain and 0 < at.time_left_s <= 10.0
    seen = []
    code = boundary.drain(4, at, lambda: pytest.fail("no time for a save"), before=seen.append)
    assert code == ExitCode.DRAINED and seen == ["SIGTERM"]
    assert read_events(run, "drain_checkpoint_skipped")


def test_the_time_limit_is_slurms_allocation_under_slurm_and_none_elsewhere(tmp_path, one_rank):
    assert slurm_time_limit_s(30, env={"SLURM_JOB_ID": "12"}) == 1800.0
    assert slurm_time_limit_s(30, env={}) is None
    boundary, _, _ = _boundary(tmp_path, one_rank)
    assert boundary.interval.time_limit_s is None  # this test runs under no SLURM job


def test_the_drain_file_is_written_through_diag_drain_gate_alone():
    # Four writers before (issue 39): the watchdog spelled "drain" itself, `rlslurm drain` imported the watchdog to
    # write it, jobs/entry.py and the trainer supervisor touched it. One writer: request_drain.
    writers = []
    for top in ("rlslurm", "jobs", "diag"):
        for path in (ROOT / top).rglob("*.py"):
            text = path.read_text()
            if path.name == "drain_gate.py" and path.parent.name == "diag":
                continue
            if "DRAIN_FILE" in text or re.search(r"control\s*/\s*[\"']drain[\"']", text):
                writers.append(str(path.relative_to(ROOT)))
    assert writers == []

"""How the RL controller and its engines find each other on SLURM: the engines announce themselves in
<run>/endpoints/engine-*.json, stamped with the job id and restart count, so a requeued job never talks
to the previous allocation's engines; the broadcast group's store listens at rank 0's node address.

    python -m pytest -q tests/unit/test_rl_endpoints.py      # < 1 s
"""

from __future__ import annotations

import json

import pytest

from rlslurm.errors import RlslurmError
from rlslurm.jobs.rl import sync_host, wait_for_endpoints
from rlslurm.rundir import RunDir


def _announce(run: RunDir, rank: int, url: str, job_id: str, restart_count: int) -> None:
    folder = run.path / "endpoints"
    folder.mkdir(exist_ok=True)
    (folder / f"engine-{rank}.json").write_text(json.dumps(
        {"url": url, "node": "n3", "pid": 1, "job_id": job_id, "restart_count": restart_count}))


def test_endpoints_of_this_start_only(tmp_path):
    run = RunDir(tmp_path / "run").create()
    _announce(run, 0, "http://old:1", "42", 0)  # engine 0 of the first allocation, not yet overwritten
    _announce(run, 1, "http://new:2", "42", 1)
    _announce(run, 2, "http://other-job:3", "7", 1)
    assert wait_for_endpoints(run, 1, timeout_s=1, job_id="42", restart_count=1) == ["http://new:2"]


def test_only_stale_endpoints_time_out_and_say_so(tmp_path):
    run = RunDir(tmp_path / "run").create()
    _announce(run, 0, "http://old:1", "42", 0)
    with pytest.raises(RlslurmError, match=r"only 0 of 1 rollout engines of job 42 restart 1 .*\(1 stale files"):
        wait_for_endpoints(run, 1, timeout_s=0.2, job_id="42", restart_count=1, poll_s=0.05)


def test_broadcast_store_host_is_rank0_node_address(monkeypatch):
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    assert sync_host() == "127.0.0.1"  # off SLURM the engines run beside rank 0
    monkeypatch.setenv("SLURMD_NODENAME", "localhost")  # a node name that resolves is used as it is
    assert sync_host() == "localhost"

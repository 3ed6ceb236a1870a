"""How the RL controller and its engines find each other on SLURM: the engines announce themselves in
<run>/endpoints/engine-*.json, the reward component in <run>/endpoints/reward.json, stamped with the job
id and restart count, so a requeued job never talks to the previous allocation's engines or reward
service; the broadcast group's store listens at rank 0's node address. And a step whose rewards were
degraded because SLURM stops the job (its SIGTERM reached the reward service) is given up, not trained.

    python -m pytest -q tests/unit/test_rl_endpoints.py      # < 1 s
"""

from __future__ import annotations

import dataclasses
import json
import os
import types

import pytest
import torch

from rlslurm.config import JobConfig
from rlslurm.errors import RewardServiceError, RlslurmError
from rlslurm.reward.session import announce, wait_for_url
from rlslurm.rl.controller import sync_host
from rlslurm.rl.engines import engine_args, wait_for_endpoints
from rlslurm.rl.experience import Experience
from rlslurm.rl.loop import _degraded_by_slurm_stop
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


def test_reward_endpoint_of_the_previous_start_is_not_taken(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run").create()
    monkeypatch.setenv("RLSLURM_LEADER_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    announce(run, "http://n5:1", "n5")  # the reward component of the first allocation
    with pytest.raises(RewardServiceError, match="job 42 restart 1 .* only a stale one"):
        wait_for_url(run, 0.2, job_id="42", restart_count=1, poll_s=0.05)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    announce(run, "http://n5:2", "n5")  # the requeued job's component replaces it
    assert wait_for_url(run, 0.2, job_id="42", restart_count=1, poll_s=0.05) == "http://n5:2"


class _Gate:
    def __init__(self, signal_name):
        self.signal_name = signal_name


@pytest.mark.parametrize("degraded, signal_name, abandoned", [
    (3, "SIGTERM", 3),  # SLURM stops the job: its reward service went away mid-step
    (3, None, 0),       # degraded for reasons of its own: reward.degrade decides, the step trains
    (0, "SIGTERM", 0),  # scored in full before the service went: the step trains, the drain keeps it
])
def test_a_step_degraded_by_slurm_stopping_the_job_is_given_up(degraded, signal_name, abandoned):
    exp = Experience([], {"reward_degraded": degraded}, {})
    assert _degraded_by_slurm_stop(exp, _Gate(signal_name), grace_s=0.01) == abandoned
    assert _degraded_by_slurm_stop(None, _Gate("SIGTERM"), grace_s=0.01) == 0


def test_engine_args_put_the_hf_engine_on_the_gpu_where_there_is_one(monkeypatch):
    job = JobConfig()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_args(job) == ["--threads", "1"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_args(job) == ["--threads", "1", "--device", "cuda"]
    vllm = dataclasses.replace(job, rollout=dataclasses.replace(job.rollout, engine="vllm"))
    assert engine_args(vllm) == ["--threads", "1"]  # vLLM places itself
    assert engine_args(vllm, threads=4) == ["--threads", "1"]


def test_spawned_engines_take_the_cores_the_trainer_leaves_idle_while_they_generate(monkeypatch):
    """Beside the trainer: every core while the ranks wait for the rollout (rl.max_staleness 0), what the ranks
    on them leave when the rollout overlaps training, shared between the engines, at least one thread."""
    from rlslurm.rl.engines import spawned_engine_threads

    job = dataclasses.replace(JobConfig(), rl=dataclasses.replace(JobConfig().rl, max_staleness=0))
    layout = types.SimpleNamespace(train_tasks_per_node=2, engines=1)  # the demo's: 2 trainer ranks, 1 engine
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert engine_args(job, spawned_engine_threads(job, layout, cores=8))[:2] == ["--threads", "8"]
    ahead = dataclasses.replace(job, rl=dataclasses.replace(job.rl, max_staleness=1))
    assert spawned_engine_threads(ahead, layout, cores=8) == 6  # 2 ranks hold a core each while they train
    assert spawned_engine_threads(ahead, layout, cores=2) == 1  # rank 0's own cores on SLURM: it trains on one
    two = types.SimpleNamespace(train_tasks_per_node=2, engines=2)
    assert spawned_engine_threads(job, two, cores=8) == 4 and spawned_engine_threads(ahead, two, cores=2) == 1


def test_an_engine_of_several_threads_lets_them_sleep_between_regions(tmp_path, monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE for an hf engine of more than one thread (spinning threads stall under load), unless
    the job's environment says otherwise; one thread gets nothing."""
    from rlslurm.rl.engines import engine_launch

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    run, job = RunDir(tmp_path / "run").create(), JobConfig()
    assert engine_launch(job, run, 0, tmp_path, host="127.0.0.1", threads=2).env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in engine_launch(job, run, 0, tmp_path, host="127.0.0.1", threads=1).env
    vllm = dataclasses.replace(job, rollout=dataclasses.replace(job.rollout, engine="vllm"))
    assert "OMP_WAIT_POLICY" not in engine_launch(vllm, run, 0, tmp_path, host="127.0.0.1", threads=2).env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in engine_launch(job, run, 0, tmp_path, host="127.0.0.1", threads=2).env

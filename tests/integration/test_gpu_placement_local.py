"""GPUs placed per task and one network environment off SLURM: a local run hands its tasks this machine's GPUs
(submitit's local executor, `gpus_per_node` of `visible_gpus`), each trainer rank takes its local rank's, each
engine spawned beside rank 0 gets rollout.tp GPUs of its own, and every process gets the job's `network:`.

    python -m pytest -q -s tests/integration/test_gpu_placement_local.py     # ~40 s on 2 idle cores

This machine has no GPU: the tests give the submitting process CUDA_VISIBLE_DEVICES=4,5,6,7, as a SLURM
allocation or a user would, and read what every process was handed (placement.jsonl, env fingerprints,
/proc/<pid>/environ). The processes compute on the CPU (gloo, the hf engine), which ignores the variable.
Before rlslurm/devices.py the local launcher passed no gpus_per_node, so submitit set an empty
CUDA_VISIBLE_DEVICES for every task (the first test fails there), and spawned engines all used rank 0's GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.errors import PreflightError
from rlslurm.layout import JobLayout
from rlslurm.plan.report import build_plan
from rlslurm.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
GPU_JOB = ("hardware.profile=h100-80g", "rollout.engines=2", "sync.method=broadcast", "train.steps=2",
           "rl.prompts_per_step=8", "rl.eval_every=100", "task.eval_size=16", "checkpoint.interval_steps=1000",
           "reward.service=local", "network.socket_ifname=lo", "network.ib_hca=mlx5_0",
           "network.extra={NCCL_NET_GDR_LEVEL: 2}")
INJECTED = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "NCCL_IB_HCA": "mlx5_0", "NCCL_NET_GDR_LEVEL": "2"}


def _environ(pid: int) -> dict[str, str]:
    """The environment a live process started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_local_run_gives_every_rank_and_engine_its_own_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    job = load_config(EXAMPLE, GPU_JOB)
    sub = launch.submit(job, config_text=EXAMPLE.read_text(), backend="local", run_root=tmp_path)
    results = launch.wait(sub, timeout_s=240, poll_s=0.2)
    assert [int(code) for code in results] == [0, 0], f"ended {results}; see {sub.run_dir}"
    layout = json.loads((sub.run_dir / "layout.json").read_text())
    assert (layout["local_gpus"], layout["spawned_engine_gpus"]) == (4, [[2], [3]])
    rows = {(p["role"], p["rank"]): p for p in read_jsonl(sub.run_dir / "placement.jsonl")}
    trainers = [rows["train", r] for r in (0, 1)]
    # Every task of the local job sees the job's GPUs of this machine, and each rank takes its local rank's.
    assert [(t["cuda_visible_devices"], t["gpus"]) for t in trainers] == [("4,5,6,7", ["4"]), ("4,5,6,7", ["5"])]
    # The engines follow the trainer ranks' GPUs (separate placement), one of its own each.
    assert [(rows["rollout", i]["cuda_visible_devices"], rows["rollout", i]["gpus"]) for i in (0, 1)] == \
           [("6", ["6"]), ("7", ["7"])]
    for rank in (0, 1):
        fp = json.loads((RunDir(sub.run_dir).env / f"train-{rank}.json").read_text())
        assert {k: fp.get(f"env.{k}") for k in INJECTED} == INJECTED
    assert [e["transport"] for e in read_jsonl(sub.run_dir / "events.jsonl") if e["kind"] == "sync_verified"] == \
           ["broadcast"] * 3  # gloo over GLOO_SOCKET_IFNAME=lo carried the weights


def test_spawned_engines_see_their_own_gpus_and_the_network_environment(init_and_run, tmp_path, monkeypatch):
    """Read from the engine processes themselves: colocated, engine i takes trainer rank 0's GPU i."""
    from rlslurm.rl.engines import Engines

    model_dir, run_dir = init_and_run
    job = load_config(EXAMPLE, GPU_JOB + ("placement.mode=colocate", "placement.rollout_nodes=null",
                                          "hardware.nodes=1", "sync.method=ipc"))
    layout = JobLayout.decide(job, build_plan(job), "slurm")  # a colocated SLURM job: rank 0 spawns them
    assert layout.spawned_engine_gpus == [[0], [1]] and layout.train_gpus_per_node == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # what SLURM showed trainer rank 0 on its node
    engines = Engines(job, layout, RunDir(Path(run_dir)), Path(model_dir))
    try:
        seen = [_environ(p.proc.pid) for p in engines.processes]
    finally:
        engines.stop()
    assert [e["CUDA_VISIBLE_DEVICES"] for e in seen] == ["2", "3"]
    assert all({k: e.get(k) for k in INJECTED} == INJECTED for e in seen)


def test_reward_service_gets_the_network_environment_and_no_gpu(tmp_path, monkeypatch):
    from rlslurm.reward.config import RewardConfig
    from rlslurm.reward.supervisor import RewardSupervisor
    from rlslurm.rl.scoring import reward_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    job = load_config(EXAMPLE, GPU_JOB)
    with RewardSupervisor(RewardConfig(), log_dir=tmp_path, env=reward_env(job)) as sup:
        seen = _environ(sup.proc.pid)
    assert {k: seen.get(k) for k in INJECTED} == INJECTED and seen["CUDA_VISIBLE_DEVICES"] == ""


def test_a_local_run_needs_the_gpus_its_layout_asks(tmp_path, monkeypatch):
    """Refused at submit, before a run directory or a task exists, naming what it needs and what the machine has."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    job = load_config(EXAMPLE, GPU_JOB)
    with pytest.raises(PreflightError, match=r"needs 4 GPUs of this machine \(2 trainer rank\(s\) and 2 engine\(s\) "
                                             r"of 1\), but it has 2 \(CUDA_VISIBLE_DEVICES='0,1'"):
        launch.submit(job, config_text=EXAMPLE.read_text(), backend="local", run_root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()  # no run directory either

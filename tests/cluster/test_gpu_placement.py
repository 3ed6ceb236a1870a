"""GPUs placed per task, and one network environment, on the real local Slurm: nodes n6 (`train-gpu`) and n7
(`rollout-gpu`) have 4 GPUs each in GRES, backed by placeholder devices (rlslurm/slurm/localcluster.py), so
SLURM allocates, binds and announces GPUs exactly as on a GPU cluster; the processes compute on the CPU (the
hf engine and gloo ignore CUDA_VISIBLE_DEVICES), and each task records what it was given in placement.jsonl.

    RLSLURM_SLURM_PORT_BASE=39817 python -m pytest -q -s tests/cluster/test_gpu_placement.py    # ~2 min

- the toy job: 4 trainer ranks on n6 (one GPU each, its local rank's), 2 engine tasks of rollout.tp 2 on n7
  (two GPUs of their own each), the reward stand-in on n5 (no GRES: no GPU, not component 0's either);
- the RL job (GRPO, broadcast sync over gloo on the nodes' eth0, GLOO_SOCKET_IFNAME from `network:`): 2 ranks, 2 engines
  of one GPU each, the reward service as component 2; trainer, engines and reward see the same network
  variables, and the job finishes;
- the same RL job on a misconfigured rollout node (its TaskProlog exports another NCCL_IB_HCA): refused
  before the first weight sync, both values named.

Before rlslurm/plan/gpus.py and rlslurm/devices.py no component asked SLURM for a GPU (every task here saw
no CUDA_VISIBLE_DEVICES at all), and two engines on one node would both have used cuda:0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import spine_util as su
from rlslurm.rundir import RunDir
from rlslurm.slurm.localcluster import GPUS_PER_NODE
from waiting import wait_for

pytestmark = pytest.mark.cluster

JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def iface(slurm_cluster) -> str:
    """The nodes' interface: eth0 in their network namespaces (rlslurm/slurm/netns.py), lo without them."""
    return "eth0" if slurm_cluster.cluster.node_network else "lo"


def network(iface: str) -> dict:
    """`network:` of these jobs (GLOO_SOCKET_IFNAME carries the gloo groups for real, across nodes)."""
    return {"socket_ifname": iface, "ib_hca": "mlx5_0", "debug": "WARN", "extra": {"NCCL_NET_GDR_LEVEL": 2}}


def injected(iface: str) -> dict[str, str]:
    """What every process of these jobs must see."""
    return {"NCCL_SOCKET_IFNAME": iface, "GLOO_SOCKET_IFNAME": iface, "NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "WARN",
            "NCCL_NET_GDR_LEVEL": "2"}


@pytest.fixture(scope="module", autouse=True)
def _tidy(slurm_cluster):
    yield
    slurm_cluster.cluster.clear_node_env("n7")  # then conftest's _cancel_and_tidy_at_end


def _config(path: Path, run_root: Path, kind: str, iface: str, **sections) -> Path:
    data = {
        "job": {"name": path.stem, "kind": kind},
        "hardware": {"profile": "h100-80g", "nodes": 2, "gpus_per_node": 2},
        "placement": {"mode": "separate", "rollout_nodes": 1},
        "network": network(iface),
        "checkpoint": {"interval_steps": 100, "kill_wait_s": su.KILL_WAIT_S, "cost_s": 0.5},
        "cluster": {"backend": "slurm", "train_partition": "train-gpu", "rollout_partition": "rollout-gpu",
                    "time_limit_min": 5, "run_root": str(run_root)},
        "reward": {"service": "component", "partition": "cpu"},
        **sections,
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _rl(path: Path, run_root: Path, iface: str) -> Path:
    return _config(path, run_root, "rl", iface,
                   train={"steps": 2, "seed": 0, "lr": 3.0e-4},
                   rl={"prompts_per_step": 8, "samples_per_prompt": 4, "eval_every": 100},
                   rollout={"engines": 2, "max_new_tokens": 4},
                   task={"eval_size": 8},
                   sync={"method": "broadcast"})


def _by_task(run: Path) -> dict[tuple[str, int], dict]:
    return {(p["role"], p["rank"]): p for p in su.placements(run, restart=0)}


def _network_seen(run: Path) -> dict[str, dict[str, str]]:
    """Each process's network variables, from the env fingerprint it wrote at its start."""
    out = {}
    for path in sorted(RunDir(run).env.glob("*.json")):
        fp = json.loads(path.read_text())
        out[path.stem] = {k[4:]: v for k, v in fp.items() if k.startswith(("env.NCCL_", "env.GLOO_"))}
    return out


def test_toy_job_every_task_gets_its_own_gpus(slurm_cluster, iface, tmp_path):
    """4 ranks x 1 GPU on n6, 2 engines x rollout.tp 2 on n7: every GPU of both nodes taken exactly once."""
    config = _config(tmp_path / "toy-gpus.yaml", tmp_path / "runs", "toy", iface,
                     hardware={"profile": "h100-80g", "nodes": 2, "gpus_per_node": GPUS_PER_NODE},
                     train={"steps": 6, "step_delay_s": 0.2}, rollout={"engines": 2, "tp": 2})
    sub = su.submit(config)
    su.wait_done(sub.job_id, sub.run_dir, JOB_TIMEOUT_S, slurm_cluster.kick)
    tasks = _by_task(sub.run_dir)
    assert sorted(tasks) == [("reward", 0), ("rollout", 0), ("rollout", 1)] + [("train", r) for r in range(4)]
    all_gpus = ",".join(map(str, range(GPUS_PER_NODE)))
    trainers = [tasks["train", r] for r in range(4)]
    for t in trainers:  # every rank sees its node's GPUs of the job and takes its local rank's
        assert (t["node"], t["cuda_visible_devices"], t["slurm_step_gpus"], t["slurm_job_gpus"]) == \
               ("n6", all_gpus, all_gpus, all_gpus), t
        assert t["gpus"] == [str(t["local_rank"])]
    assert sorted(g for t in trainers for g in t["gpus"]) == all_gpus.split(",")
    engines = [tasks["rollout", r] for r in range(2)]
    for e in engines:  # SLURM binds each engine task to its own rollout.tp GPUs (srun --gpus-per-task)
        assert e["node"] == "n7" and len(e["gpus"]) == 2 and e["cuda_visible_devices"] == ",".join(e["gpus"]), e
        assert e["slurm_step_gpus"] == e["cuda_visible_devices"]
    assert sorted(g for e in engines for g in e["gpus"]) == all_gpus.split(",")  # two engines never share one
    reward = tasks["reward", 0]
    assert (reward["node"], reward["cuda_visible_devices"], reward["gpus"]) == ("n5", "", [])
    (started,) = [e for e in su.events(sub.run_dir, "component_started") if e["component_role"] == "rollout"]
    assert started["srun_args"] == ["--gpus-per-task=2"]
    seen = _network_seen(sub.run_dir)
    assert sorted(seen) == ["reward-0", "rollout-0", "rollout-1"] + [f"train-{r}" for r in range(4)]
    assert all(v == injected(iface) for v in seen.values()), seen


def test_rl_het_job_places_gpus_and_shares_one_network_environment(slurm_cluster, iface, tmp_path):
    sub = su.submit(_rl(tmp_path / "rl-gpus.yaml", tmp_path / "runs", iface))
    su.wait_done(sub.job_id, sub.run_dir, JOB_TIMEOUT_S, slurm_cluster.kick)
    tasks = _by_task(sub.run_dir)
    assert sorted(tasks) == [("reward", 0), ("rollout", 0), ("rollout", 1), ("train", 0), ("train", 1)]
    assert [(tasks["train", r]["node"], tasks["train", r]["cuda_visible_devices"], tasks["train", r]["gpus"])
            for r in (0, 1)] == [("n6", "0,1", ["0"]), ("n6", "0,1", ["1"])]
    engines = sorted((tasks["rollout", r]["node"], tasks["rollout", r]["cuda_visible_devices"]) for r in (0, 1))
    assert engines == [("n7", "0"), ("n7", "1")]  # one GPU each, not both on cuda:0
    assert (tasks["reward", 0]["node"], tasks["reward", 0]["cuda_visible_devices"]) == ("n5", "")
    seen = _network_seen(sub.run_dir)
    assert {"train-0", "train-1", "rollout-0", "rollout-1", "reward-0"} <= set(seen)
    assert all(v == injected(iface) for v in seen.values()), seen
    assert not [e for e in su.events(sub.run_dir, "env_diff") if not e["ok"]]
    verified = su.events(sub.run_dir, "sync_verified")
    assert {e["transport"] for e in verified} == {"broadcast"} and {e["version"] for e in verified} == {0, 1, 2}


def test_rl_het_job_on_a_misconfigured_rollout_node_is_refused_naming_both_values(slurm_cluster, iface, tmp_path):
    """n7's own setup (its TaskProlog) overrides NCCL_IB_HCA for every task there, after srun passed the
    job's: the engines run with another value than trainer rank 0, and broadcast sync is refused."""
    slurm_cluster.cluster.set_node_env("n7", {"NCCL_IB_HCA": "mlx5_9"})
    try:
        sub = su.submit(_rl(tmp_path / "rl-misconfigured.yaml", tmp_path / "runs", iface))
        wait_for(f"job {sub.job_id} to fail", lambda: su.state(sub.job_id) == "FAILED", JOB_TIMEOUT_S,
                 on_poll=slurm_cluster.kick, poll_s=0.5)
    finally:
        slurm_cluster.cluster.clear_node_env("n7")
    seen = _network_seen(sub.run_dir)
    assert seen["train-0"]["NCCL_IB_HCA"] == "mlx5_0" and seen["rollout-0"]["NCCL_IB_HCA"] == "mlx5_9"
    (diff,) = su.events(sub.run_dir, "env_diff")
    assert not diff["ok"]
    report = diff["report"]
    assert "env.NCCL_IB_HCA differs between trainer rank 0 and the engines" in report, report
    assert "trainer rank 0 mlx5_0; rollout mlx5_9" in report and "sync.method = 'disk'" in report
    assert not su.events(sub.run_dir, "sync_verified")  # refused before the first sync
    logs = "".join(p.read_text(errors="replace") for p in (sub.run_dir / "logs" / "submitit").glob("*_0_log.err"))
    assert "env mismatch: env.NCCL_IB_HCA" in logs and "mlx5_9" in logs, logs[-3000:]

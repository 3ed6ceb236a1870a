"""GPUs placed per task, decided once: the plan's GPU asks (rlslurm/plan/gpus.py), the layout that carries them
(rlslurm/layout.py), the sbatch script that asks SLURM for them, what each task is handed (rlslurm/devices.py)
and the local cluster's placeholder GPUs. Real runs: tests/integration/test_gpu_placement_local.py and
tests/cluster/test_gpu_placement.py.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.devices import component_step, local_gpu_ids, machine_gpus, seen, spawned_engine_env, visible_gpus
from rlslurm.errors import ConfigError, PreflightError, RlslurmError
from rlslurm.layout import JobLayout
from rlslurm.plan.render import render_json, render_text
from rlslurm.plan.report import build_plan, preflight
from rlslurm.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
GPU = ("hardware.profile=h100-80g",)


def _job(*sets: str):
    return load_config(EXAMPLE, sets)


def _layout(backend: str, *sets: str) -> JobLayout:
    job = _job(*sets)
    return JobLayout.decide(job, build_plan(job), backend)


# -- the plan ------------------------------------------------------------------------------------------------

def test_the_cpu_profile_asks_for_no_gpu():
    plan = build_plan(_job())
    assert plan.gpus.as_dict() == {"asked": False, "per_train_task": 0, "per_engine": 0, "train_per_node": 0,
                                   "engines_per_node": 1, "rollout_per_node": 0}
    assert "GPUs: none asked (hardware.profile cpu" in render_text(plan)
    lay = JobLayout.decide(plan.job, plan, "slurm")
    assert (lay.train_gpus_per_node, lay.rollout_gpus_per_node, lay.gpus_per_engine) == (0, 0, 0)


def test_a_gpu_profile_asks_one_gpu_per_rank_and_tp_per_engine():
    plan = build_plan(_job(*GPU, "hardware.gpus_per_node=4", "rollout.engine=vllm", "rollout.engines=2",
                           "rollout.tp=2"))
    assert plan.gpus.as_dict() == {"asked": True, "per_train_task": 1, "per_engine": 2, "train_per_node": 4,
                                   "engines_per_node": 2, "rollout_per_node": 4}
    text = render_text(plan)
    assert "GPUs: train 4 per node (1 per rank, its local rank's); rollout 4 per node (2 engine(s) x rollout.tp 2, " \
           "each its own); reward none" in text
    assert json.loads(render_json(plan))["gpus"]["rollout_per_node"] == 4


def test_the_plan_never_chooses_a_node_asked_for_more_gpus_than_it_has():
    """placement.mode auto on 3 nodes of 2 GPUs, 4 engines of TP 1: colocated (4 beside trainer rank 0) and one
    rollout node (4 on it) each ask a node for 4 GPUs, shown with the keys and numbers; the plan takes 2 rollout
    nodes (2 engines, 2 GPUs each)."""
    # In turn (rl.max_staleness 0): colocation, its phases added up, is then the faster option it refuses.
    plan = build_plan(_job(*GPU, "placement.mode=auto", "placement.rollout_nodes=null", "hardware.nodes=3",
                           "rollout.engines=4", "rl.max_staleness=0"))
    assert (plan.placement, plan.chosen.rollout_nodes) == ("separate", 2)
    assert not [p for p in preflight(plan) if "GPUs" in p]
    refused = {(o.placement, o.split.rollout_nodes) for o in plan.options if "more GPUs than a node has" in o.reasons}
    assert refused == {("colocate", 0), ("separate", 1)}
    (one_node,) = {b for o in plan.options if (o.placement, o.split.rollout_nodes) == ("separate", 1)
                   for b in o.blockers if b.startswith("GPUs:")}
    assert one_node.startswith("GPUs: rollout.engines = 4 on 1 rollout node(s) is 4 engine(s) of rollout.tp = 1 per "
                               "node, 4 GPUs of their own, but hardware.gpus_per_node = 2")
    assert "faster but refused: colocate, ipc sync" in render_text(plan) and "more GPUs than a node has" in \
        render_text(plan)


def test_the_plan_refuses_a_layout_whose_every_option_asks_a_node_for_more_gpus_than_it_has():
    """5 engines on 3 nodes of 2 GPUs: colocated 5, one rollout node 5, two rollout nodes 3 on a node; every
    option over-asks, and plan and submit refuse, naming the keys and the numbers."""
    # In turn (rl.max_staleness 0): the fastest of the refused options, the one preflight names, is colocation.
    job = _job(*GPU, "placement.mode=auto", "placement.rollout_nodes=null", "hardware.nodes=3", "rollout.engines=5",
               "rl.max_staleness=0")
    plan = build_plan(job)
    assert all("more GPUs than a node has" in o.reasons for o in plan.options)
    two_nodes = {b for o in plan.options if o.split.rollout_nodes == 2 for b in o.blockers if b.startswith("GPUs:")}
    assert two_nodes == {"GPUs: rollout.engines = 5 on 2 rollout node(s) is 3 engine(s) of rollout.tp = 1 per node, "
                         "3 GPUs of their own, but hardware.gpus_per_node = 2: lower rollout.engines or rollout.tp, or "
                         "give rollout more nodes (placement.rollout_nodes)"}
    (problem,) = [p for p in preflight(plan) if "GPUs:" in p]
    assert "GPUs: rollout.engines = 5 of rollout.tp = 1 colocated beside trainer rank 0 need 5 GPUs of their own on " \
           "its node, but hardware.gpus_per_node = 2" in problem
    assert f"preflight: REFUSE: {problem}" in render_text(plan)
    with pytest.raises(PreflightError, match="need 5 GPUs of their own on its node, but hardware.gpus_per_node = 2"):
        launch.checked_plan(job)


def test_the_plan_refuses_colocated_engines_that_would_share_a_gpu():
    job = _job(*GPU, "placement.mode=colocate", "placement.rollout_nodes=null", "hardware.nodes=1",
               "sync.method=ipc", "rollout.engines=3")
    (problem,) = [p for p in preflight(build_plan(job)) if "GPUs:" in p]
    assert "rollout.engines = 3 of rollout.tp = 1 colocated beside trainer rank 0 need 3 GPUs of their own on its " \
           "node, but hardware.gpus_per_node = 2 (two engines would share one)" in problem
    # The cpu profile has no GPUs to share: its engines are processes.
    cpu = _job("placement.mode=colocate", "placement.rollout_nodes=null", "hardware.nodes=1", "sync.method=ipc",
               "rollout.engines=3")
    assert not [p for p in preflight(build_plan(cpu)) if "GPUs:" in p]


def test_gpus_in_gres_are_refused_where_the_plan_asks_them():
    with pytest.raises(ConfigError, match="cluster.gres_per_node = 'gpu:2' asks for GPUs, which a job of "
                                          "hardware.profile = 'h100-80g' asks itself from the plan"):
        _job(*GPU, "cluster.backend=slurm", "cluster.gres_per_node=gpu:2")
    with pytest.raises(ConfigError, match="sets --gpus-per-node, which rlslurm sets from the plan's GPU placement"):
        _job(*GPU, "cluster.backend=slurm", "cluster.extra_sbatch=[--gpus-per-node=2]")


# -- the layout ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,sets,expected", [
    ("slurm", (), dict(train_gpus_per_node=2, rollout_gpus_per_node=2, local_gpus=0, spawned_engine_gpus=[])),
    ("local", (), dict(train_gpus_per_node=2, rollout_gpus_per_node=2, local_gpus=4, spawned_engine_gpus=[[2], [3]])),
    ("slurm", ("placement.mode=colocate", "placement.rollout_nodes=null", "hardware.nodes=1", "sync.method=ipc"),
     dict(train_gpus_per_node=2, rollout_gpus_per_node=0, local_gpus=0, spawned_engine_gpus=[[0], [1]])),
    ("local", ("placement.mode=colocate", "placement.rollout_nodes=null", "hardware.nodes=1", "sync.method=ipc"),
     dict(train_gpus_per_node=2, rollout_gpus_per_node=0, local_gpus=2, spawned_engine_gpus=[[0], [1]])),
], ids=["slurm-separate", "local-separate", "slurm-colocate", "local-colocate"])
def test_the_layout_carries_the_gpus_of_every_component(backend, sets, expected, tmp_path):
    lay = _layout(backend, *GPU, "rollout.engines=2", *sets)
    assert {k: getattr(lay, k) for k in expected} == expected
    assert (lay.gpus_per_train_task, lay.gpus_per_engine) == (1, 1)
    run = RunDir(tmp_path / "run").create()
    lay.write(run)
    assert JobLayout.read(run) == lay


def test_a_layout_written_before_gpus_were_placed_still_reads(tmp_path):
    run = RunDir(tmp_path / "run").create()
    old = {k: v for k, v in _layout("slurm").to_dict().items() if "gpu" not in k}
    run.layout.write_text(json.dumps(old))
    lay = JobLayout.read(run)
    assert (lay.train_gpus_per_node, lay.spawned_engine_gpus) == (0, [])


# -- the sbatch script ---------------------------------------------------------------------------------------

def _script(*sets: str) -> str:
    job = _job("cluster.backend=slurm", *sets)
    lay = JobLayout.decide(job, build_plan(job), "slurm")
    from rlslurm.slurm.hetjob import ScriptRenderer, submission_script

    return submission_script(launch._slurm_executor(job, Path("/runs/r"), lay, ScriptRenderer))


def test_every_component_asks_slurm_for_its_gpus():
    lines = _script(*GPU, "rollout.engines=2", "reward.service=component", "reward.partition=cpu").splitlines()
    het = [i for i, ln in enumerate(lines) if ln == "#SBATCH hetjob"]
    comp0, comp1, comp2 = lines[:het[0]], lines[het[0]:het[1]], lines[het[1]:]
    assert "#SBATCH --gpus-per-node=2" in comp0  # one per trainer rank
    assert "#SBATCH --gpus-per-node=2" in comp1  # 2 engines x rollout.tp 1
    assert not [ln for ln in comp2 if ln.startswith("#SBATCH") and "gpu" in ln]  # the reward service takes none
    assert "export CUDA_VISIBLE_DEVICES=" not in lines


def test_a_job_that_asks_no_gpu_sees_none():
    lines = _script().splitlines()
    assert not [ln for ln in lines if ln.startswith("#SBATCH") and "gpu" in ln]
    assert "export CUDA_VISIBLE_DEVICES=" in lines


# -- what each task is handed --------------------------------------------------------------------------------

def test_the_rollout_step_binds_each_engine_to_its_own_gpus():
    lay = _layout("slurm", *GPU, "hardware.gpus_per_node=4", "rollout.engine=vllm", "rollout.engines=2",
                  "rollout.tp=2", "reward.service=component", "reward.partition=cpu")
    assert component_step(lay, 1) == (["--gpus-per-task=2"], {})
    assert component_step(lay, 2) == ([], {"CUDA_VISIBLE_DEVICES": ""})  # no GRES node keeps the batch's value
    assert component_step(_layout("slurm"), 1) == ([], {"CUDA_VISIBLE_DEVICES": ""})


def test_spawned_engines_take_their_positions_among_rank0s_gpus():
    lay = _layout("local", *GPU, "rollout.engines=2")
    assert [spawned_engine_env(lay, i, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) for i in (0, 1)] == \
           [{"CUDA_VISIBLE_DEVICES": "6"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    assert spawned_engine_env(lay, 1, {}) == {"CUDA_VISIBLE_DEVICES": "3"}  # all visible: positions are ids
    with pytest.raises(RlslurmError, match=r"engine 1 takes GPU position\(s\) \[3\] of trainer rank 0's, but rank 0 "
                                           r"sees 2 \(CUDA_VISIBLE_DEVICES='4,5'\)"):
        spawned_engine_env(lay, 1, {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert spawned_engine_env(_layout("local", "rollout.engines=2"), 0, {}) == {"CUDA_VISIBLE_DEVICES": ""}


def test_what_a_task_records_of_its_gpus():
    lay = _layout("slurm", *GPU)
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "0,1", "SLURM_JOB_GPUS": "0,1"}
    assert seen(lay, "train", 1, env) == {"cuda_visible_devices": "0,1", "slurm_step_gpus": "0,1",
                                         "slurm_job_gpus": "0,1", "gpus": ["1"]}
    assert seen(lay, "rollout", 0, {"CUDA_VISIBLE_DEVICES": "2,3"})["gpus"] == ["2", "3"]
    assert seen(lay, "reward", 0, {"CUDA_VISIBLE_DEVICES": ""})["gpus"] == []
    assert seen(lay, "train", 2, env)["gpus"] == []  # no GPU of its own: dist.bind_local_gpu refuses to start
    assert seen(_layout("slurm"), "train", 0, env)["gpus"] == []  # the cpu profile takes none


def test_the_machines_gpus_for_a_local_run(tmp_path):
    assert visible_gpus({}) is None and visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert machine_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    for name in ("nvidia0", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert machine_gpus({}, dev=str(tmp_path)) == ["0", "1"]  # CUDA numbers what the driver shows from 0
    lay = _layout("local", *GPU, "rollout.engines=2")
    assert local_gpu_ids(lay, {"CUDA_VISIBLE_DEVICES": "4,5,6,7,8"}) == [4, 5, 6, 7]
    with pytest.raises(PreflightError, match="names GPUs by UUID or MIG id"):
        local_gpu_ids(lay, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"})
    assert local_gpu_ids(_layout("local"), {}) == []  # the cpu profile: an empty CUDA_VISIBLE_DEVICES


def test_a_rank_without_a_gpu_of_its_own_refuses_to_start():
    import torch

    from rlslurm.dist import bind_local_gpu

    count = torch.cuda.device_count()
    with pytest.raises(RlslurmError, match=f"local rank {count} has no GPU of its own: this task sees {count}"):
        bind_local_gpu(count)
    assert bind_local_gpu(count, required=False) is None


# -- the local cluster's GPU nodes ---------------------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of the placeholder devices needs root (as the cluster does)")
def test_the_local_cluster_backs_gpu_gres_with_placeholder_devices(tmp_path):
    from rlslurm.slurm.localcluster import GPU_NODES, GPUS_PER_NODE, LocalCluster

    cluster = LocalCluster(tmp_path, port_base=16817)
    cluster.write_config()
    conf = cluster.conf.read_text()
    assert "GresTypes=gpu" in conf
    nodes = {line.split()[0][len("NodeName="):]: line for line in conf.splitlines() if line.startswith("NodeName=")}
    assert sorted(nodes) == [f"n{i}" for i in range(1, 8)]
    assert all(f"CPUs={GPUS_PER_NODE} RealMemory=2000 Gres=gpu:{GPUS_PER_NODE} " in nodes[n] for n in GPU_NODES)
    assert not [n for n, line in nodes.items() if "Gres=" in line and n not in GPU_NODES]  # CPU nodes: no GRES
    assert "PartitionName=train-gpu Nodes=n6" in conf and "PartitionName=rollout-gpu Nodes=n7" in conf
    gres = (tmp_path / "gres.conf").read_text()
    assert gres == f"NodeName=n[6-7] Name=gpu File={tmp_path}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n"
    for i in range(GPUS_PER_NODE):  # slurmd 22.05 takes only character or block devices for File=
        assert stat.S_ISCHR((tmp_path / "dev" / f"gpu{i}").stat().st_mode)
    cluster.set_node_env(GPU_NODES[1], {"NCCL_IB_HCA": "mlx5_9"})
    assert (tmp_path / "node-env" / "n7").read_text() == "export NCCL_IB_HCA=mlx5_9\n"
    with pytest.raises(RlslurmError, match="is not NAME=word"):
        cluster.set_node_env("n7", {"A": "two words"})
    cluster.clear_node_env("n7")
    assert not (tmp_path / "node-env" / "n7").exists()

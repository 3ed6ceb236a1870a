"""One network environment for every component: `network:` (rlslurm/network.py), validated at load, shown by
`rlslurm plan`, written into the sbatch script and the local launch, and compared by env-diff between trainer
rank 0 and the engines. The real runs: tests/cluster/test_gpu_placement.py (a het job, and one whose rollout
node overrides a variable) and tests/integration/test_gpu_placement_local.py (every process's environment).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.diag.env_diff import compare, read_fingerprints, write_fingerprint
from rlslurm.errors import ConfigError, PreflightError
from rlslurm.layout import JobLayout
from rlslurm.network import NetworkConfig, network_env
from rlslurm.plan.render import render_json, render_text
from rlslurm.plan.report import build_plan
from rlslurm.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
NETWORK = ("network.socket_ifname=ib0", "network.ib_hca='mlx5_0,mlx5_1'", "network.ib_timeout=22",
           "network.debug=WARN", "network.extra={NCCL_NET_GDR_LEVEL: 2, UCX_TLS: 'rc,sm'}")
ENV = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_IB_TIMEOUT": "22",
       "NCCL_NET_GDR_LEVEL": "2", "NCCL_SOCKET_IFNAME": "ib0", "UCX_TLS": "rc,sm"}


def test_the_section_builds_one_environment():
    assert network_env(NetworkConfig()) == {}
    job = load_config(EXAMPLE, NETWORK)
    assert network_env(job.network) == ENV


@pytest.mark.parametrize("setting,fragments", [
    ("network.extra={NCCL_SOCKET_IFNAME: eth0}", ["network.extra.NCCL_SOCKET_IFNAME", "set by network.socket_ifname"]),
    ("network.extra={PATH: /tmp}", ["network.extra.PATH", "is not a network variable", "NCCL_, GLOO_"]),
    ("network.extra={nccl_debug: INFO}", ["network.extra.nccl_debug", "is not a network variable"]),
    ("network.extra={NCCL_ALGO: true}", ["network.extra.NCCL_ALGO", "must be str or int"]),
    ("network.extra={NCCL_BUFFSIZE: -1}", ["network.extra.NCCL_BUFFSIZE", "must be >= 0"]),
    ("network.ib_timeout=40", ["network.ib_timeout = 40 must be <= 31", "[1, 31]"]),
    ("network.ib_retry_cnt=8", ["network.ib_retry_cnt = 8 must be <= 7"]),
    ("network.debug=LOUD", ["network.debug = 'LOUD' must be 'VERSION' | 'WARN' | 'INFO' | 'TRACE' or null"]),
    ("network.socket_ifname='eth0 eth1'", ["network.socket_ifname", "interface names or prefixes"]),
    ("network.ib_hca='mlx5_0;rm -rf'", ["network.ib_hca", "HCA names"]),
    ("network.sockets=eth0", ["network.sockets is not a key of network", "socket_ifname"]),
])
def test_a_bad_network_value_names_the_key_and_the_rule(setting, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, (setting,))
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_plan_shows_the_environment_in_text_and_json():
    plan = build_plan(load_config(EXAMPLE, NETWORK))
    assert ("network environment of every trainer rank, engine and the reward service: GLOO_SOCKET_IFNAME=ib0 "
            "NCCL_DEBUG=WARN NCCL_IB_HCA=mlx5_0,mlx5_1") in render_text(plan)
    assert json.loads(render_json(plan))["network_env"] == ENV
    assert "network environment: none set" in render_text(build_plan(load_config(EXAMPLE)))


def test_the_sbatch_script_and_the_local_launch_hand_it_to_every_task():
    from rlslurm.slurm.hetjob import ScriptRenderer, submission_script

    job = load_config(EXAMPLE, NETWORK + ("cluster.backend=slurm", "network.extra={UCX_TLS: 'rc sm'}"))
    lay = JobLayout.decide(job, build_plan(job), "slurm")
    script = submission_script(launch._slurm_executor(job, Path("/runs/r"), lay, ScriptRenderer))
    setup = script.split("# setup\n")[1].split("\n\n")[0].splitlines()
    assert "export NCCL_SOCKET_IFNAME=ib0" in setup and "export NCCL_IB_HCA=mlx5_0,mlx5_1" in setup
    assert "export UCX_TLS='rc sm'" in setup  # quoted for the shell
    local = launch.dry_run(load_config(EXAMPLE, NETWORK), backend="local", run_root="/tmp/nowhere")
    assert "NCCL_SOCKET_IFNAME=ib0" in local and "UCX_TLS=rc,sm" in local


@pytest.fixture
def run(tmp_path, monkeypatch):
    """Fingerprints of trainer ranks 0 and 1 and one engine, all with the job's network environment."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    run = RunDir(tmp_path / "run").create()
    for role, rank in (("train", 0), ("train", 1), ("rollout", 0)):
        write_fingerprint(run, role, rank)
    return run


def _plant(run: RunDir, name: str, **env: str | None) -> None:
    path = run.env / f"{name}.json"
    fp = json.loads(path.read_text())
    for key, value in env.items():
        if value is None:
            fp.pop(f"env.{key}")
        else:
            fp[f"env.{key}"] = value
    path.write_text(json.dumps(fp))


def test_an_engine_with_another_network_variable_refuses_broadcast_naming_both_values(run):
    assert compare(read_fingerprints(run.path)).ok
    _plant(run, "rollout-0", NCCL_IB_HCA="mlx5_9")
    diff = compare(read_fingerprints(run.path), sync_method="broadcast")
    with pytest.raises(PreflightError) as err:
        diff.raise_errors()
    message = str(err.value)
    assert "env.NCCL_IB_HCA differs between trainer rank 0 and the engines of its broadcast group (trainer rank 0 " \
           "mlx5_0,mlx5_1; rollout mlx5_9;" in message
    assert "a node's own setup" in message and "sync.method = 'disk'" in message
    assert compare(read_fingerprints(run.path), sync_method="disk").ok  # disk needs no group: a warning


def test_a_variable_unset_on_the_engine_is_named_too(run):
    _plant(run, "rollout-0", NCCL_SOCKET_IFNAME=None)
    (error,) = compare(read_fingerprints(run.path)).errors
    assert "trainer rank 0 ib0; rollout <unset>" in error.message


def test_a_difference_on_another_trainer_rank_is_not_the_groups(run):
    """Only trainer rank 0 joins the engines' group; another rank's difference stays a warning."""
    _plant(run, "train-1", NCCL_DEBUG="INFO")
    diff = compare(read_fingerprints(run.path))
    assert diff.ok and any("env.NCCL_DEBUG differs among the train ranks" in w.message for w in diff.warnings)


def test_the_controller_refuses_before_its_first_broadcast_sync(run):
    from types import SimpleNamespace

    from rlslurm.events import read_events
    from rlslurm.rl.controller import Controller

    _plant(run, "rollout-0", GLOO_SOCKET_IFNAME="eth9")
    with pytest.raises(PreflightError, match="env.GLOO_SOCKET_IFNAME differs between trainer rank 0 and the engines"):
        Controller.check_env(SimpleNamespace(run=run, transport=SimpleNamespace(name="broadcast")))
    (event,) = read_events(run, "env_diff")
    assert event["ok"] is False and "trainer rank 0 ib0; rollout eth9" in event["report"]


def test_an_interface_each_node_chose_for_itself_is_listed_not_compared(tmp_path, monkeypatch):
    """Trainer and engine nodes may name their interfaces differently (ib0, eth0) with nothing misconfigured:
    what bind_to_node_address derived from the node refuses nothing; the same difference set by hand does."""
    from rlslurm import dist

    monkeypatch.setattr(dist, "node_address", lambda node: "127.0.0.1")  # this node's address: on lo
    run = RunDir(tmp_path / "run").create()
    for role, iface in (("train", "lo"), ("rollout", "eth7")):
        env = {"SLURMD_NODENAME": f"{role}-node"}
        assert dist.bind_to_node_address(env) == "lo"
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = iface  # as a node with another name would
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RLSLURM_NODE_DERIVED_ENV"):
            monkeypatch.setenv(name, env[name])
        write_fingerprint(run, role, 0)
    fp = json.loads((run.env / "rollout-0.json").read_text())
    assert "env.NCCL_SOCKET_IFNAME" not in fp
    assert fp["node_derived"] == "GLOO_SOCKET_IFNAME=eth7,NCCL_SOCKET_IFNAME=eth7"
    assert compare(read_fingerprints(run.path), sync_method="broadcast").ok

    # A component started by trainer rank 0's srun inherits its node's choice: derived again on its own node.
    inherited = {"SLURMD_NODENAME": "rollout-node", "GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "eth7",
                 "RLSLURM_NODE_DERIVED_ENV": "GLOO_SOCKET_IFNAME,NCCL_SOCKET_IFNAME"}
    assert dist.bind_to_node_address(inherited) == "lo" and inherited["NCCL_SOCKET_IFNAME"] == "lo"
    set_by_job = {"SLURMD_NODENAME": "rollout-node", "NCCL_SOCKET_IFNAME": "ib0"}
    assert dist.bind_to_node_address(set_by_job) == "lo" and set_by_job["NCCL_SOCKET_IFNAME"] == "ib0"

    monkeypatch.delenv("RLSLURM_NODE_DERIVED_ENV")  # the job (or a node's prolog) set it: compared
    write_fingerprint(run, "rollout", 0)
    assert not compare(read_fingerprints(run.path), sync_method="broadcast").ok

"""Nodes with addresses of their own: each slurmd of the local cluster runs in a network namespace with its own
address on a private bridge (rlslurm/slurm/netns.py), so the roles must bind and dial what SLURM gives them.

    RLSLURM_SLURM_PORT_BASE=41817 python -m pytest -q -s tests/cluster/test_node_network.py

- every node answers at its own NodeAddr, and a task sees that address on its own interface;
- two ranks on two nodes join one gloo group at the first node's NodeAddr (rlslurm.dist: MASTER_ADDR from
  SLURM, gloo bound to the interface holding the node's address) and all-reduce across the bridge;
- a node's link cut mid-step (its veth at the bridge set down): SLURM finds it not responding and requeues
  the whole het job off it (NODE_FAIL), the restart names the lost node (`node_lost`), `rlslurm diag`
  says so, and the job resumes from its last complete checkpoint and finishes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import spine_util as su
from rlslurm import secret
from rlslurm.cli.main import cli
from rlslurm.slurm import commands, parse
from spine_util import STEPS
from waiting import wait_for

pytestmark = pytest.mark.cluster

JOB_TIMEOUT_S = 240


def _net(slurm_cluster):
    net = slurm_cluster.cluster.network()
    assert net is not None, "the test cluster runs without per-node addresses (RLSLURM_LOCAL_NODE_NETWORK=0)"
    return net


def test_every_node_has_its_own_address_and_a_task_sees_it(slurm_cluster):
    net = _net(slurm_cluster)
    addrs = {n: commands.show_node(n)[0]["NodeAddr"] for n in net.nodes}
    assert addrs == {n: net.address(n) for n in net.nodes} and len(set(addrs.values())) == len(addrs)
    assert not any(a.startswith("127.") for a in addrs.values())
    out = commands.run(["srun", "-p", "train", "-N2", "-n2", "--time=1", sys.executable, "-c",
                        "import os; from rlslurm.dist import interface_of, node_address; "
                        "n = os.environ['SLURMD_NODENAME']; a = node_address(n); print(n, a, interface_of(a))"],
                       timeout_s=60).stdout
    seen = sorted(line.split() for line in out.splitlines() if line.strip())
    assert seen == [["n1", addrs["n1"], "eth0"], ["n2", addrs["n2"], "eth0"]], out


GLOO = """
import os, torch, torch.distributed as dist
from rlslurm.dist import Topology, bind_to_node_address, init_process_group
iface = bind_to_node_address()
topo = Topology.detect()
init_process_group(topo, timeout_s=60, backend="gloo")
x = torch.tensor([float(topo.rank + 1)])
dist.all_reduce(x)
print(os.environ["SLURMD_NODENAME"], topo.master_addr, iface, x.item(), flush=True)
dist.destroy_process_group()
"""


def test_two_ranks_on_two_nodes_meet_at_the_address_slurm_gives(slurm_cluster, tmp_path, monkeypatch):
    net = _net(slurm_cluster)
    # The rendezvous on a node's address admits only ranks that hold the job's secret (rlslurm/jobstore.py):
    # srun hands this environment to both tasks, as a job's run directory would.
    monkeypatch.setenv(secret.ENV_VAR, str(secret.ensure(tmp_path / "secret")))
    out = commands.run(["srun", "-p", "train", "-N2", "-n2", "--time=2", sys.executable, "-c", GLOO],
                       timeout_s=120).stdout
    rows = sorted(line.split() for line in out.splitlines() if line.strip())
    assert rows == [["n1", net.address("n1"), "eth0", "3.0"], ["n2", net.address("n1"), "eth0", "3.0"]], out


def test_a_node_cut_off_mid_step_is_named_and_the_job_requeued_off_it(slurm_cluster, tmp_path):
    net = _net(slurm_cluster)
    sub = su.submit(su.toy_config(tmp_path / "cut.yaml", tmp_path / "runs", step_delay_s=0.3))
    run = Path(sub.run_dir)
    wait_for("the toy job past its first checkpoint", lambda: su.last_step(run) >= su.INTERVAL + 1,
             JOB_TIMEOUT_S, on_poll=slurm_cluster.kick)
    (rollout,) = {p["node"] for p in su.placements(run, "rollout", 0)}
    cut_at = time.time()
    net.cut(rollout)
    try:
        wait_for(f"SLURM to requeue job {sub.job_id} off {rollout}", lambda: su.placements(run, "train", 1),
                 JOB_TIMEOUT_S, on_poll=slurm_cluster.kick)
        took = su.wait_done(sub.job_id, run, JOB_TIMEOUT_S, slurm_cluster.kick)
    finally:
        net.mend(rollout)
    (lost,) = su.events(run, "node_lost")
    assert lost["node"] == rollout and lost["restart_count"] == 1, lost
    assert "DOWN" in lost["state"] or "NOT_RESPONDING" in lost["state"], lost
    assert {p["node"] for p in su.placements(run, restart=1)}.isdisjoint({rollout})
    (resumed,) = su.events(run, "resume")
    assert resumed["restart_count"] == 1 and resumed["step"] >= su.INTERVAL
    assert su.last_step(run) == STEPS
    result = CliRunner().invoke(cli, ["diag", str(run), "--out", str(tmp_path / "bundle"), "--no-live"])
    assert result.exit_code == 0, result.output
    assert f"node failure: {rollout} lost (" in result.output, result.output
    print(f"MEASURE cut link of {rollout}: the restart off it named the node {lost['t'] - cut_at:.1f} s after the "
          f"cut (SlurmdTimeout 20 s, then SLURM's requeue); the job was done {took:.1f} s after the restart appeared")
    _return_to_service(rollout)


def _return_to_service(node: str) -> None:
    """Give a cut node back to the other tests: once its slurmd answers again, RESUME it if SLURM holds it DOWN."""
    wait_for(f"{node}'s slurmd answering again", lambda: "NOT_RESPONDING" not in commands.show_node(node)[0]["State"],
             60, poll_s=1)
    if "DOWN" in commands.show_node(node)[0]["State"]:
        commands.scontrol("update", f"NodeName={node}", "State=RESUME")
    wait_for(f"{node} idle", lambda: commands.show_node(node)[0]["State"].startswith("IDLE"), 60, poll_s=1)


# A rollout node lost is test_a_node_cut_off_mid_step_... above (SLURM requeues every component itself: measured
# with "rollout" here too, 15.9 s); only the train node's loss splits the job, so CI sets that one DOWN.
@pytest.mark.parametrize("role", ["train"])
def test_a_node_set_down_requeues_every_component_together_and_the_job_resumes(slurm_cluster, tmp_path, role):
    """The node of one het component set DOWN mid-run (what slurmctld does to a node whose slurmd stops
    answering, without its timeout; the local cluster's ReturnToService=1 keeps it DOWN until this test returns
    it, so the job cannot start on it again): SLURM requeues that component and ends the other (FAILED,
    JobLaunchFailure), a split job that would pend for good; the job's strigger (rlslurm/slurm/rejoin.py)
    requeues it whole, off the lost node, and it resumes and finishes. diag names the node and SLURM's state;
    status shows the node kept off."""
    sub = su.submit(su.toy_config(tmp_path / f"down-{role}.yaml", tmp_path / "runs", step_delay_s=0.3))
    run = Path(sub.run_dir)
    wait_for("the toy job past its first checkpoint", lambda: su.last_step(run) >= su.INTERVAL + 1,
             JOB_TIMEOUT_S, on_poll=slurm_cluster.kick)
    (node,) = {p["node"] for p in su.placements(run, role, 0)}
    down_at = time.time()
    commands.scontrol("update", f"NodeName={node}", "State=DOWN", f"Reason=test_{role}_node_down")
    try:
        wait_for(f"job {sub.job_id} requeued whole, off {node}", lambda: su.placements(run, "train", 1),
                 JOB_TIMEOUT_S, on_poll=slurm_cluster.kick, poll_s=0.5)
        back_at = min(p["t"] for p in su.placements(run, restart=1))
        su.wait_done(sub.job_id, run, JOB_TIMEOUT_S, slurm_cluster.kick)
        node_state_at_done = commands.show_node(node)[0]["State"]
        status = CliRunner().invoke(cli, ["status", str(run)]).output
    finally:
        if "DOWN" in commands.show_node(node)[0]["State"]:  # RESUME of a node SLURM returned itself is refused
            commands.scontrol("update", f"NodeName={node}", "State=RESUME")
    assert {r.get("HetJobOffset", "0"): r["JobState"] for r in commands.show_job(sub.job_id)} == \
        {"0": "COMPLETED", "1": "COMPLETED"}
    rejoined = su.events(run, "components_requeued")
    if role == "train" or rejoined:  # measured: a train node lost splits the job; SLURM may requeue all itself
        assert rejoined and rejoined[0]["excluded"] == [node], su.events(run)[-12:]
        assert set(rejoined[0]["states"].values()) >= {"PENDING"}, rejoined
        assert f"kept off node {node}: lost at restart 1" in status and "SLURM excluded it" in status, status
        assert node in parse.expand_nodelist(commands.show_job(sub.job_id)[0]["ExcNodeList"])
    (lost,) = su.events(run, "node_lost")
    assert lost["node"] == node and "DOWN" in lost["state"] and lost["restart_count"] == 1, lost
    # Still DOWN when the job finished: nothing but this test's RESUME (in `finally`) returns it.
    assert "DOWN" in node_state_at_done, node_state_at_done
    assert {p["node"] for p in su.placements(run, restart=1)}.isdisjoint({node})
    assert {p["role"] for p in su.placements(run, restart=1)} == {"train", "rollout"}
    assert su.events(run, "resume")[0]["step"] >= su.INTERVAL and su.last_step(run) == STEPS
    su.wait_for("no process of the run left", lambda: not su.leftovers(run), 30, poll_s=0.5)
    result = CliRunner().invoke(cli, ["diag", str(run), "--out", str(tmp_path / "bundle"), "--no-live"])
    assert result.exit_code == 0, result.output
    assert f"node failure: {node} lost (" in result.output and f"test_{role}_node_down" in result.output, \
        result.output
    print(f"MEASURE {role} node set DOWN: the job ran again (all components) {back_at - down_at:.1f} s later "
          f"({'rejoined by its strigger' if rejoined else 'SLURM requeued every component itself'})")
    wait_for(f"{node} idle", lambda: commands.show_node(node)[0]["State"].startswith("IDLE"), 60, poll_s=1)

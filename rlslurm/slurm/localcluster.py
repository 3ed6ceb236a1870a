"""A throwaway real Slurm cluster on this machine: munge + slurmctld + 7 slurmd, all state in one directory.

    python -m rlslurm.slurm.localcluster up --dir /tmp/slurm      # prints `export SLURM_CONF=...`
    eval "$(python -m rlslurm.slurm.localcluster up --dir /tmp/slurm)"
    python -m rlslurm.slurm.localcluster status --dir /tmp/slurm
    python -m rlslurm.slurm.localcluster down --dir /tmp/slurm

Runs as root (Debian's slurmctld/slurmd/munge, Slurm 22.05); touches no system path: keys, sockets, logs,
spool, state and pid files all live under --dir, and `down` stops only the PIDs of its own pid files.

Layout (facts behind it: /work/shared/notes/slurm-local.md):

    partition  nodes     why
    train      n[1-2]    het component 0 (trainer + controller)
    rollout    n[3-4]    het component 1 (rollout engines)
    cpu        n5        het component 2 (reward service). Its own node: the components of one het job
                         must land on distinct nodes, and a node shared with train/rollout let a 3-part
                         het job wait forever behind its own components.
    urgent     n[1-5]    PriorityTier=10: a job here preempts (REQUEUEs) jobs of the others; for tests
    train-gpu  n6        4 CPUs and 4 GPUs each: GPU GRES (gres.conf File=) backed by placeholder devices,
    rollout-gpu n7       character devices under <dir>/dev with /dev/null's numbers (slurmd 22.05 refuses a
                         regular file: "is not a valid character or block device"). A job that asks for GPUs
                         here gets CUDA_VISIBLE_DEVICES, SLURM_JOB_GPUS, SLURM_STEP_GPUS and --gpus-per-task
                         binding as on a GPU cluster; n1-n5 have no GRES, so a test opts in by partition.

Every task runs the cluster's TaskProlog, which prints `export NAME=value` lines from
<dir>/node-env/<node> when that file exists (`set_node_env`): how a test gives one node an environment of its
own, as a misconfigured node's own setup would (SLURM applies TaskProlog exports over what srun passed).

Network: each node in a network namespace of its own, with its own address on a private bridge
(rlslurm/slurm/netns.py: 10.A.B.11-17, A.B from the port base); slurmctld and munged stay in the root
namespace, which the nodes reach at its own address. RLSLURM_LOCAL_NODE_NETWORK=0 puts every node on
127.0.0.1 instead (the fallback where namespaces cannot be made).

Ports: slurmctld `port_base` (16817 by default, or $RLSLURM_SLURM_PORT_BASE), slurmd port_base+184 ..
+190; two clusters on one machine need two port bases (and two dirs). Job ids start at
1 + 1000 * (port_base - 16817), so jobs of two clusters never derive the same rendezvous port.
cred_expire=5 makes a requeued job restart after ~6 s instead of ~136 s. SlurmdTimeout=20: a node that stops
answering (its link cut) is DOWN, and its jobs requeued off it, after ~20 s instead of 300. ReturnToService=1:
such a node comes back by itself once its slurmd answers again, but one set DOWN by `scontrol` stays DOWN until
the test returns it (`State=RESUME`); with 2, slurmd's next registration handed it back within 28 ms, and the
requeued job could start on the very node it had lost (issue 28, case 6). Accounting is off;
finished jobs are in `jobcomp.txt` (read with `sacct -c`, see commands.sacct).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlslurm.errors import SlurmCommandError
from rlslurm.slurm import commands
from rlslurm.slurm.netns import NodeNetwork, host_address

log = logging.getLogger("rlslurm.slurm.localcluster")

CPU_NODES = ("n1", "n2", "n3", "n4", "n5")
GPU_NODES = ("n6", "n7")
NODES = CPU_NODES + GPU_NODES
GPUS_PER_NODE = 4
"""Placeholder GPUs of each GPU node (and its CPUs: 2 engines of TP 2, or 4 trainer ranks, fit one)."""
CTLD_PORT = 16817
SLURMD_PORT_OFFSET = 184  # slurmd ports sit this far above slurmctld's (17001-17007 by default)
PARTITIONS = {"train": "n[1-2]", "rollout": "n[3-4]", "cpu": "n5", "train-gpu": "n6", "rollout-gpu": "n7"}
URGENT_PARTITION = "urgent"
TASK_PROLOG = """\
#!/bin/sh
# Written by rlslurm.slurm.localcluster: a node's own environment for its tasks (LocalCluster.set_node_env).
f={env_dir}/"$SLURMD_NODENAME"
if [ -f "$f" ]; then cat "$f"; fi
exit 0
"""
NODE_NETWORK_ENV = "RLSLURM_LOCAL_NODE_NETWORK"

SLURM_CONF = """\
# Written by rlslurm.slurm.localcluster: a throwaway test cluster, all state under {d}
ClusterName=rlslurm-local
SlurmctldHost={ctld_host}
SlurmUser=root
SlurmctldPort={ctld_port}
FirstJobId={first_job_id}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock,cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
PlugStackConfig={d}/plugstack.conf
TaskProlog={d}/task_prolog.sh
GresTypes=gpu
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=5
SlurmdTimeout=20
MinJobAge=600
InactiveLimit=0
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{node_lines}
{partitions}
PartitionName={urgent} Nodes=n[1-5] PriorityTier=10 MaxTime=INFINITE State=UP
"""


OWNER_FILE = "owner"
"""<dir>/owner: "PID START_TIME" of the process the cluster lives for (a test session), written by `claim`."""


@dataclass(frozen=True)
class LocalCluster:
    """Paths of a local cluster under `dir`; `up()` starts it, `down()` stops it."""

    dir: Path
    port_base: int = int(os.environ.get("RLSLURM_SLURM_PORT_BASE", CTLD_PORT))
    node_network: bool = os.environ.get(NODE_NETWORK_ENV, "1") != "0"
    """Each node in a network namespace of its own with its own address (rlslurm/slurm/netns.py); False (or
    RLSLURM_LOCAL_NODE_NETWORK=0): every node on 127.0.0.1, the fallback where namespaces cannot be made."""

    conf = property(lambda self: self.dir / "slurm.conf")
    munge_socket = property(lambda self: self.dir / "munge.sock")

    @property
    def env(self) -> dict[str, str]:
        """What a client needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def pid_files(self) -> list[Path]:
        """slurmd first, then slurmctld, then munged: the order to stop them in."""
        return [self.dir / f"slurmd-{n}.pid" for n in NODES] + [self.dir / "slurmctld.pid", self.dir / "munged.pid"]

    def write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "dev", "node-env", *(f"spool/{n}" for n in NODES)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "plugstack.conf").write_text("")  # keep the system's SPANK plugins out of the test cluster
        prolog = d / "task_prolog.sh"
        prolog.write_text(TASK_PROLOG.format(env_dir=shlex.quote(str(d / "node-env"))))
        prolog.chmod(0o755)
        for i in range(GPUS_PER_NODE):  # placeholder GPUs: character devices with /dev/null's numbers
            dev = d / "dev" / f"gpu{i}"
            if not dev.exists():
                os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (d / "gres.conf").write_text(f"NodeName=n[6-7] Name=gpu File={d}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n")
        parts = "\n".join(f"PartitionName={p} Nodes={n} Default={'YES' if p == 'train' else 'NO'} "
                          f"PriorityTier=1 MaxTime=INFINITE State=UP" for p, n in PARTITIONS.items())
        first = self.port_base + SLURMD_PORT_OFFSET
        net = self.network()
        # slurmctld stays in the root namespace; the nodes reach it at the host's own address
        ctld_host = "localhost" if net is None else f"localhost({net.host})"
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr={net.address(n) if net else '127.0.0.1'} "
                           f"Port={first + i} {_resources(n)}" for i, n in enumerate(NODES))
        self.conf.write_text(SLURM_CONF.format(d=d, ctld_port=self.port_base, ctld_host=ctld_host, node_lines=nodes,
                                               first_job_id=1 + 1000 * (self.port_base - CTLD_PORT),
                                               partitions=parts, urgent=URGENT_PARTITION))

    def set_node_env(self, node: str, env: dict[str, str]) -> None:
        """Give every task that starts on `node` from now on these variables, over what srun passed (through
        the TaskProlog): a node whose own setup differs from the others'. Values are single words."""
        if node not in NODES:
            raise SlurmCommandError(f"no node {node!r} in the local cluster ({', '.join(NODES)})")
        for name, value in env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not re.fullmatch(r"[^\s'\"\\]+", value):
                raise SlurmCommandError(f"set_node_env: {name}={value!r} is not NAME=word")
        (self.dir / "node-env" / node).write_text("".join(f"export {k}={v}\n" for k, v in env.items()))

    def clear_node_env(self, node: str) -> None:
        """Undo set_node_env: the node's tasks get what srun passes again."""
        (self.dir / "node-env" / node).unlink(missing_ok=True)

    def network(self) -> NodeNetwork | None:
        """The nodes' private network (None with node_network off); the same for every call of one cluster."""
        return NodeNetwork.for_port_base(self.port_base, NODES, host=self._host()) if self.node_network else None

    def _host(self) -> str:
        """The host address the network was made with (kept in the cluster's dir for `down` and the tests)."""
        path = self.dir / "host-address"
        if not path.exists():
            self.dir.mkdir(parents=True, exist_ok=True)
            path.write_text(host_address())
        return path.read_text().strip()

    def up(self, *, timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> float:
        """Start munged, slurmctld (cold) and one slurmd per node; wait until every node is idle.
        Returns the seconds it took. Raises SlurmCommandError (with the daemon log's tail) on failure."""
        started = clock()
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.running():
            raise SlurmCommandError(f"a local cluster already runs from {self.dir} (down it first)")
        self.write_config()
        d = self.dir
        if not (d / "munge.key").exists():
            _daemon(["mungekey", "-c", "-k", str(d / "munge.key")], d / "mungekey.log")
        _daemon(["munged", f"--socket={self.munge_socket}", f"--key-file={d / 'munge.key'}",
                 f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                 f"--seed-file={d / 'munged.seed'}", "--force"], d / "munged.out")
        net = self.network()
        if net is not None:
            net.up()
        _daemon(["slurmctld", "-f", str(self.conf), "-c"], d / "slurmctld.out")
        for node in NODES:
            prefix = net.exec_prefix(node) if net is not None else []
            _daemon([*prefix, "slurmd", "-f", str(self.conf), "-N", node], d / f"slurmd-{node}.out")
        self.wait_idle(timeout_s=timeout_s - (clock() - started), clock=clock, sleep=sleep)
        return clock() - started

    def wait_idle(self, *, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> None:
        """Poll `sinfo` every 0.2 s until all nodes are idle, for at most timeout_s."""
        deadline = clock() + timeout_s
        log.info("waiting up to %.0f s for nodes %s to be idle", timeout_s, ",".join(NODES))
        last = "no answer yet"
        while clock() < deadline:
            try:
                states = self.node_states()
                last = str(states)
                if set(states) == set(NODES) and all(s == "idle" for s in states.values()):
                    return
            except SlurmCommandError as e:
                last = str(e)
            sleep(0.2)
        raise SlurmCommandError(f"local cluster in {self.dir} not idle after {timeout_s:.0f} s: {last}\n"
                                + self.log_tails())

    def node_states(self) -> dict[str, str]:
        return commands.node_states(env=self.env, timeout_s=5)

    def kick(self) -> None:
        """Make the scheduler look again. On an idle test cluster a requeued het job sits pending
        (Reason=None) until something changes; a no-op partition update is such a change."""
        commands.scontrol("update", "PartitionName=train", "State=UP", env=self.env)

    def pids(self) -> dict[str, int]:
        out = {}
        for f in self.pid_files():
            try:
                out[f.stem] = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return out

    def running(self) -> dict[str, int]:
        """Daemons of this cluster that are alive, by pid file."""
        return {name: pid for name, pid in self.pids().items() if _alive(pid)}

    def claim(self, pid: int | None = None) -> None:
        """Record the process this cluster lives for (default: this one); once it is gone, `orphaned` says so."""
        import psutil

        pid = pid or os.getpid()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / OWNER_FILE).write_text(f"{pid} {psutil.Process(pid).create_time()}\n")

    def orphaned(self) -> bool:
        """Its daemons run, and the process it was claimed for is gone (its pid dead or now another process's).
        A cluster nobody claimed (`localcluster up` by hand) is never orphaned: it is somebody's to stop."""
        import psutil

        try:
            pid, started = (self.dir / OWNER_FILE).read_text().split()
            owner_started = psutil.Process(int(pid)).create_time()
        except (OSError, ValueError):
            return False
        except psutil.Error:
            owner_started = None
        gone = owner_started is None or abs(owner_started - float(started)) > 1.0
        return gone and bool(self.running())

    def down(self, *, grace_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> list[str]:
        """Cancel every job of this cluster (bounded by grace_s), then TERM every daemon (PIDs read before
        signalling) and KILL what is left after grace_s. Jobs first: a job step outlives a killed slurmd
        and would keep running, orphaned, into the next test."""
        pids = self.running()
        if "slurmctld" in pids:
            self._cancel_all_jobs(grace_s, clock, sleep)
        for name, pid in pids.items():
            log.info("stopping %s (pid %d)", name, pid)
            os.kill(pid, signal.SIGTERM)
        deadline = clock() + grace_s
        while clock() < deadline and any(_alive(p) for p in pids.values()):
            sleep(0.1)
        for name, pid in pids.items():
            if _alive(pid):
                log.warning("%s (pid %d) ignored SIGTERM for %.0f s: SIGKILL", name, pid, grace_s)
                os.kill(pid, signal.SIGKILL)
        if self.node_network and (self.dir / "host-address").exists():
            self.network().down()
        return sorted(pids)

    def _cancel_all_jobs(self, grace_s: float, clock: Callable[[], float],
                         sleep: Callable[[float], None]) -> None:
        env = self.env
        try:
            commands.run(["scancel", "--full", "--user", "root"], env=env, check=False, timeout_s=grace_s)
            deadline = clock() + grace_s
            while clock() < deadline:
                out = commands.run(["squeue", "-h", "-o", "%i", "-t", "PD,R,CG,S,RQ,RS,SE"], env=env,
                                   check=False, timeout_s=grace_s).stdout
                if not out.strip():
                    return
                sleep(0.2)
            log.warning("jobs still listed %.0f s after scancel: %s", grace_s, " ".join(out.split()))
        except SlurmCommandError as e:  # a half-started cluster: nothing to cancel
            log.info("no jobs cancelled: %s", e)

    def log_tails(self, lines: int = 8) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            if tail:
                out.append(f"--- {f}\n" + "\n".join(tail))
        return "\n".join(out)


def orphaned_clusters(port_base: int, root: Path | None = None) -> list[LocalCluster]:
    """The clusters in `root`'s rlslurm-cluster-* dirs (default: the temp dir) on `port_base` whose owner is gone
    while their daemons run: a test session killed before its teardown (SIGTERM or SIGKILL to pytest) leaves its
    cluster up, and the next session on the same ports then failed every cluster test at setup."""
    found = []
    for d in sorted((root or Path(tempfile.gettempdir())).glob("rlslurm-cluster-*")):
        try:
            conf = (d / "slurm.conf").read_text()
        except OSError:
            continue
        cluster = LocalCluster(d, port_base=port_base)
        if re.search(rf"^SlurmctldPort={port_base}$", conf, re.M) and cluster.orphaned():
            found.append(cluster)
    return found


def _resources(node: str) -> str:
    """slurm.conf's resources of a node: 2 CPUs, or 4 CPUs and 4 placeholder GPUs on the GPU nodes."""
    if node in GPU_NODES:
        return f"CPUs={GPUS_PER_NODE} RealMemory=2000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
    return "CPUs=2 RealMemory=2000 State=UNKNOWN"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours is not alive; reap it if it is one.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _daemon(argv: list[str], out: Path) -> None:
    """Run a daemon's start command (each daemonizes itself and writes its pid file)."""
    log.info("start: %s", " ".join(argv))
    with out.open("ab") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=30)
    if proc.returncode != 0:
        raise SlurmCommandError(f"`{' '.join(argv)}` exited {proc.returncode}; see {out}:\n"
                                + out.read_text(errors="replace")[-2000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlslurm.slurm.localcluster", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--dir", required=True, type=Path, help="directory holding all the cluster's state")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="how long `up` waits for idle nodes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cluster = LocalCluster(args.dir.resolve())
    if args.action == "up":
        took_s = cluster.up(timeout_s=args.timeout_s)
        print(f"export SLURM_CONF={cluster.conf}")
        print(f"# local cluster up in {took_s:.1f} s; partitions: "
              + ", ".join(f"{p}={n}" for p, n in {**PARTITIONS, URGENT_PARTITION: 'n[1-5]'}.items())
              + f"; n6, n7: {GPUS_PER_NODE} placeholder GPUs each", file=sys.stderr)
    elif args.action == "down":
        stopped = cluster.down()
        print(f"stopped: {', '.join(stopped) or 'nothing was running'}", file=sys.stderr)
    else:
        alive = cluster.running()
        print(f"export SLURM_CONF={cluster.conf}")
        print("daemons: " + (", ".join(f"{n}={p}" for n, p in alive.items()) or "none running"), file=sys.stderr)
        if alive:
            try:
                print("nodes: " + ", ".join(f"{n}={s}" for n, s in cluster.node_states().items()), file=sys.stderr)
            except SlurmCommandError as e:
                print(f"nodes: {e}", file=sys.stderr)
        return 0 if alive else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

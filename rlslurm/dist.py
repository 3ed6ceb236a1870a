"""Who am I in the job: rank, world size, local rank, master address — from whichever launcher ran us.

Launchers set different variables: SLURM tasks get SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, submitit's
local executor only SUBMITIT_LOCAL_* (no RANK, no MASTER_ADDR), torchrun RANK/WORLD_SIZE/LOCAL_RANK.
`Topology.detect()` maps them to one shape; `init_process_group(topo)` picks gloo on CPU and NCCL on GPU,
so the CPU path and the GPU path are the same code.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlslurm.network import NODE_DERIVED_ENV

# torch is imported where it is used: Topology and free_port serve processes that hold no torch (`rlslurm submit
# --wait`, the job entry of a reward component), and torch's import is ~250 MB of private memory per process.
if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Topology:
    """This process's place among the tasks of one component of the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def detect(cls, env: dict[str, str] | None = None, default_port: int = 29500) -> "Topology":
        e = os.environ if env is None else env
        if "RANK" in e and "WORLD_SIZE" in e:
            rank, world, local = int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0))
        elif "SUBMITIT_LOCAL_GLOBALID" in e:
            # submitit 1.5.4's local executor (submitit/local/local.py, its _env table).
            rank = int(e["SUBMITIT_LOCAL_GLOBALID"])
            world = int(e["SUBMITIT_LOCAL_NTASKS"])
            local = int(e.get("SUBMITIT_LOCAL_LOCALID", rank))
        elif "SLURM_PROCID" in e:
            rank, world = int(e["SLURM_PROCID"]), int(e.get("SLURM_NTASKS", 1))
            local = int(e.get("SLURM_LOCALID", 0))
        else:
            rank, world, local = 0, 1, 0
        addr = e.get("MASTER_ADDR") or _first_slurm_node(e) or "127.0.0.1"
        port = int(e.get("MASTER_PORT") or _port_for_job(e) or default_port)
        return cls(rank, world, local, addr, port)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _port_for_job(e) -> int | None:
    """A rendezvous port every task of one job start computes alike, distinct across jobs and restarts
    (two jobs on one node must not both take 29500; a restart must not meet its predecessor's socket)."""
    job = e.get("RLSLURM_LEADER_JOB_ID") or e.get("SLURM_JOB_ID")
    if not job or not job.isdigit():
        return None
    # A trainer restart inside the allocation (rlslurm/slurm/supervisor.py) is a start too: a port of its own.
    restart = int(e.get("SLURM_RESTART_COUNT", "0")) + 7919 * int(e.get("RLSLURM_TRAINER_RESTART") or 0)
    return 15000 + (int(job) * 8 + restart) % 30000


def free_port() -> int:
    """A TCP port free on this host right now (for local runs, which have no job id to derive one from)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _first_slurm_node(e) -> str | None:
    nodelist = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    from rlslurm.slurm.parse import expand_nodelist  # lazily: this module stays light off SLURM

    return node_address(expand_nodelist(nodelist)[0])


def node_address(node: str) -> str:
    """An address of a SLURM node that peers can connect to: its resolvable name, else slurmd's NodeAddr
    (on the local test cluster each node's own address in its network namespace; no name resolves)."""
    import socket

    try:
        socket.gethostbyname(node)
        return node
    except OSError:
        pass
    from rlslurm.slurm import commands

    for record in commands.show_node(node):
        if record.get("NodeAddr"):
            return record["NodeAddr"]
    return node


def interface_of(address: str) -> str | None:
    """The local network interface holding `address`, or None (an address of another machine, or a name)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def bind_to_node_address(env=None) -> str | None:
    """Make gloo and NCCL bind the address SLURM gives this node (its NodeAddr, see node_address): both pick an
    interface from the machine's hostname by default, and where it resolves to loopback (a container, a
    test cluster whose nodes live in network namespaces) they bind 127.0.0.1 and peers on other nodes never
    reach them. Sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless the job set them; returns the
    interface, or None off SLURM or where the node's address is on no local interface."""
    e = os.environ if env is None else env
    node = e.get("SLURMD_NODENAME")
    if not node:
        return None
    iface = interface_of(node_address(node))
    if iface is not None:
        # A value another process derived for its node (trainer rank 0 starts the other components with srun,
        # which hands them its environment) is that node's, not the job's: derived again here.
        inherited = set(filter(None, e.get(NODE_DERIVED_ENV, "").split(",")))
        derived = [name for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in e or name in inherited]
        for name in derived:
            e[name] = iface
        # Said so in the environment: a value this node worked out for itself may differ between nodes by
        # design (ib0 here, eth0 there), so env-diff keeps it out of its train/rollout comparison.
        if derived:
            e[NODE_DERIVED_ENV] = ",".join(derived)
    return iface


def backend_for_device() -> str:
    """nccl where CUDA is available, gloo otherwise: the one switch between GPU and CPU paths."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def compute_device() -> torch.device:
    """Where this rank's tensors live: the GPU init_process_group made current where CUDA is available,
    else the CPU. With backend_for_device, the one switch: NCCL reduces only GPU tensors, so every tensor a
    collective of the default group sees must be made here (models, batches, the step-boundary flags)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def bind_local_gpu(local_rank: int, required: bool = True) -> torch.device | None:
    """Make this rank's own GPU current: its local rank's among those it sees (rlslurm/devices.py says who
    shows which). A rank without one of its own raises (RlslurmError) rather than share a GPU with a peer;
    with `required` False (a gloo job on a GPU node) it stays on the CPU then."""
    import torch

    count = torch.cuda.device_count()
    if local_rank >= count:
        if not required:
            return None
        from rlslurm.errors import RlslurmError

        raise RlslurmError(f"local rank {local_rank} has no GPU of its own: this task sees {count} "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); the job "
                           "asks one per trainer rank (layout.json: train_gpus_per_node), so its node or machine "
                           "gave it fewer")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def release_process_group_users() -> None:
    """Collective, before `destroy_process_group`: drop the last references that models hold to the group
    while every peer is still connected, then meet once more.

    DDP's Reducer holds the process group; freed only when the model was (after `destroy_process_group`, at
    the function's return), it ran gloo's destructor there, which waits for the group's work queue to drain
    and joins its threads: a finished run's rank 1 waited in it for good, its peer gone (CI, py-spy
    --native: `~ProcessGroupGloo` -> `std::thread::join` from the Reducer's dealloc). Callers drop their own
    references to the model first; the collection here frees what cycles still hold."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()


_default_store = None
"""The store of this process's default group (init_process_group)."""


def init_process_group(topo: Topology, timeout_s: float = 120.0, backend: str | None = None,
                       token: str | None = None) -> None:
    """Join the default process group of this component; a peer that never comes raises at timeout_s.
    `backend` (default backend_for_device()): "gloo" for a job that computes on the CPU even on a GPU node.
    The rendezvous is the job's store (rlslurm/jobstore.py), hosted by rank 0 on MASTER_ADDR only (never every
    interface, as torch's own tcp:// store does), and joined only by ranks that prove the job's secret (`token`,
    default: the run's secret file, jobstore.job_token())."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = backend or backend_for_device()
    if torch.cuda.is_available():
        # Before the first collective: NCCL takes the current device, and two local ranks left on cuda:0
        # fail with "Duplicate GPU detected" (the object collectives use the current device too).
        bind_local_gpu(topo.local_rank, required=backend == "nccl")
    from rlslurm.jobstore import job_token, rendezvous_store

    global _default_store
    # Held here for the life of the process: torch keeps only the C++ side of a Python store, and a group made
    # later (new_group, Megatron's) would call a store whose Python half was collected ("Not implemented").
    _default_store = store = rendezvous_store(topo.master_addr, topo.master_port, rank=topo.rank,
                                              world_size=topo.world_size, timeout_s=timeout_s, token=job_token(token))
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=topo.rank,
        world_size=topo.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )

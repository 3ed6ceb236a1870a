"""Which node this process runs on: the name SLURM knows it by, else the hostname.

    from rlslurm.node import node_name
    node_name()          # "n3" in a SLURM task (SLURMD_NODENAME), socket.gethostname() elsewhere

Every record that says where something ran (events, heartbeats, placement, starts, checkpoint manifests)
and every filter on it (the node agent watches the heartbeats of its own node) uses this one name.
"""

from __future__ import annotations

import os
import socket


def node_name() -> str:
    """SLURMD_NODENAME where SLURM started us, else the hostname.

    Not the hostname alone: several slurmd may run on one host (the local test cluster's n1..n5 share
    it), and `scontrol` and `srun -w` address nodes by SLURM's name, not the host's.
    """
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()

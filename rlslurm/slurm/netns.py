"""The local cluster's private network: each node in a network namespace of its own, with its own address on
a bridge of its own, so that a process binding or dialling the wrong interface fails in a test as it would
on a cluster, and a node can be cut off mid-step.

    net = NodeNetwork.for_port_base(41817, ("n1", "n2", "n3", "n4", "n5"))
    net.up()                        # namespaces, bridge, veth pairs, routes (root; iproute2)
    net.address("n1")               # "10.163.89.11": slurm.conf's NodeAddr of n1
    net.exec_prefix("n1")           # ["nsenter", "--net=/run/netns/rls41817-n1"]: how its slurmd starts
    net.cut("n3"); net.mend("n3")   # its link at the bridge down / up again
    net.down()

Topology, all on this machine:

    root namespace: munged, slurmctld, clients    <tag>h --- veth ---+
                                                                     br0   (namespace <tag>-lan)
    namespace <tag>-n1: lo, eth0 10.A.B.11/24   --- veth --- v-n1 ---+
    ...                                                              |
    namespace <tag>-n5: lo, eth0 10.A.B.15/24   --- veth --- v-n5 ---+

Every 10.x address lives inside a namespace made here. The root end of its veth has none: the root
namespace reaches the subnet through a route on that veth with one of its own addresses as the source
(`host`), and each node namespace reaches exactly that host address on-link (slurmctld's, and srun's when a
client on the root side launches a step). No namespace has a default route, so nothing is forwarded beyond
this machine: a node reaches its peers, its own loopback and the host address, nothing else. munge's socket
is a file, which every namespace sees.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass

from rlslurm.errors import SlurmCommandError

log = logging.getLogger("rlslurm.slurm.netns")


class NetworkError(SlurmCommandError):
    """The per-node network could not be made (no root, no iproute2, namespaces refused)."""


def _ip(*args: str, check: bool = True) -> str:
    argv = ["ip", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetworkError(f"`{' '.join(argv)}` failed: {e}") from None
    if check and done.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def host_address() -> str:
    """One global IPv4 address of the root namespace: the source of its packets into the node subnet (and
    slurmctld's address there). A machine with none has nothing the nodes could reach it at."""
    for line in _ip("-4", "-o", "addr", "show", "scope", "global").splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    raise NetworkError("the root network namespace has no global IPv4 address for the nodes to reach it at")


@dataclass(frozen=True)
class NodeNetwork:
    """The namespaces, addresses and links of one local cluster's nodes (see the module docstring)."""

    tag: str
    """Prefix of every namespace and of the root-side veth, unique per cluster (its port base)."""
    subnet: str
    """The first three octets of the nodes' /24, e.g. 10.163.89."""
    nodes: tuple[str, ...]
    host: str
    """The root namespace's address the nodes reach it at."""

    @classmethod
    def for_port_base(cls, port_base: int, nodes: tuple[str, ...], host: str | None = None) -> "NodeNetwork":
        """Two clusters with distinct port bases get distinct namespaces and subnets."""
        return cls(f"rls{port_base}", f"10.{port_base // 256 % 256}.{port_base % 256}", tuple(nodes),
                   host or host_address())

    @property
    def lan(self) -> str:
        return f"{self.tag}-lan"

    @property
    def root_link(self) -> str:
        return f"{self.tag}h"

    def namespace(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{11 + self.nodes.index(node)}"

    def exec_prefix(self, node: str) -> list[str]:
        """Prepended to a command, runs it in `node`'s network namespace (slurmd, and whatever it starts).
        nsenter, not `ip netns exec`: that one also makes a mount namespace with /sys remounted for the
        namespace, where /sys/fs/cgroup is gone and slurmd refuses to start ("Unable to initialize cgroup")."""
        return ["nsenter", f"--net=/run/netns/{self.namespace(node)}"]

    def up(self) -> None:
        """Make the namespaces, the bridge, one veth pair per node and one to the root namespace, and the
        routes; what a previous run of the same tag left behind is removed first."""
        self.down()
        lan = self.lan
        _ip("netns", "add", lan)
        _ip("-n", lan, "link", "add", "br0", "type", "bridge")
        _ip("-n", lan, "link", "set", "br0", "up")
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", "up0", "netns", lan)
        _ip("-n", lan, "link", "set", "up0", "master", "br0", "up")
        _ip("link", "set", self.root_link, "up")
        _ip("route", "add", f"{self.subnet}.0/24", "dev", self.root_link, "src", self.host)
        for node in self.nodes:
            ns = self.namespace(node)
            _ip("netns", "add", ns)
            _ip("-n", lan, "link", "add", f"v-{node}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", lan, "link", "set", f"v-{node}", "master", "br0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", f"{self.host}/32", "dev", "eth0")
        log.info("node network %s: %s, host %s", self.tag,
                 ", ".join(f"{n}={self.address(n)}" for n in self.nodes), self.host)

    def cut(self, node: str) -> None:
        """Cut `node` off: its link at the bridge goes down (its processes live on, unreachable)."""
        _ip("-n", self.lan, "link", "set", f"v-{node}", "down")

    def mend(self, node: str) -> None:
        _ip("-n", self.lan, "link", "set", f"v-{node}", "up")

    def down(self) -> None:
        """Remove the namespaces (their veths go with them) and the root-side veth; absent ones are fine."""
        existing = set(_ip("netns", "list", check=False).split())
        for ns in [self.namespace(n) for n in self.nodes] + [self.lan]:
            if ns in existing:
                _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.root_link, check=False)

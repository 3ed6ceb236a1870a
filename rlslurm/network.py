"""`network:` in a job YAML: the NCCL / Gloo network environment every process of the job runs with.

    network:
      socket_ifname: ib0           # NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
      ib_hca: mlx5_0,mlx5_1        # NCCL_IB_HCA
      ib_timeout: 22               # NCCL_IB_TIMEOUT
      debug: WARN                  # NCCL_DEBUG
      extra: {NCCL_NET_GDR_LEVEL: 2, UCX_TLS: rc}

    env = network_env(job.network)    # {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0", ...}

One function builds it and every launcher of the job hands it down: the sbatch script's setup lines (the
trainer ranks of component 0, and every srun step they start), the `srun --het-group` steps of the rollout
and reward components (jobs/entry.py), the engines spawned beside trainer rank 0 (rlslurm/rl/engines.py),
the reward service under its supervisor (rlslurm/reward/supervisor.py) and a local run's tasks
(rlslurm/launch.py). A trainer and an engine in one broadcast group must agree on it: diag/env_diff.py
compares the NETWORK_PREFIXES variables each process saw at its start and refuses broadcast sync when train
and rollout differ, naming both values (a node whose own setup overrides one, e.g. a TaskProlog, shows up
there). `rlslurm plan` prints the environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rlslurm.configfile import FieldError, check, check_range, check_text

NETWORK_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "UCX_")
"""Names of the variables `network.extra` may set, and that env-diff compares between train and rollout."""
NODE_DERIVED_ENV = "RLSLURM_NODE_DERIVED_ENV"
"""Names of the variables a process set from its own node (rlslurm/dist.py bind_to_node_address: the node's
interface), comma-separated: env-diff lists them and does not compare them."""

_NAME = re.compile(r"(?:NCCL|GLOO|TORCH_NCCL|TORCH_DISTRIBUTED|UCX)_[A-Z0-9_]{1,64}")
_IFNAME = re.compile(r"[\^=]?[A-Za-z0-9_.:-]{1,64}(,[A-Za-z0-9_.:-]{1,64}){0,31}")
"""NCCL_SOCKET_IFNAME: interface names or prefixes, comma-separated; a leading ^ excludes, = matches exactly."""
_HCA = re.compile(r"[\^=]?[A-Za-z0-9_.-]{1,64}(:\d{1,3})?(,[A-Za-z0-9_.-]{1,64}(:\d{1,3})?){0,31}")
"""NCCL_IB_HCA: HCA names with an optional :port, comma-separated; ^ excludes, = matches exactly."""
MAX_EXTRA = 64
"""Entries network.extra may hold."""


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    socket_ifname: str | None = None
    """Network interface(s) of NCCL's and Gloo's sockets (NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME), e.g. ib0,
    eth0 or ^docker,lo; null = each library picks."""
    ib_hca: str | None = None
    """InfiniBand / RoCE adapters NCCL uses (NCCL_IB_HCA), e.g. mlx5_0,mlx5_1 or =mlx5_0:1; null = all."""
    ib_timeout: int | None = None
    """NCCL_IB_TIMEOUT: an InfiniBand verbs timeout of 4.096 us x 2^value; null = NCCL's default. Range [1, 31]."""
    ib_retry_cnt: int | None = None
    """NCCL_IB_RETRY_CNT: InfiniBand retries before a connection fails; null = NCCL's default. Range [0, 7]."""
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = None
    """NCCL_DEBUG: what NCCL logs (INFO shows the transports and interfaces it chose); null = NCCL's default."""
    extra: dict[str, str | int] = field(default_factory=dict)
    """Further variables for every process of the job, e.g. {NCCL_NET_GDR_LEVEL: 2, UCX_TLS: rc}: names
    start with NCCL_, GLOO_, TORCH_NCCL_, TORCH_DISTRIBUTED_ or UCX_ (at most 64 entries); values are
    strings of at most 256 characters or integers. Range [0, 1e18]."""

    def __post_init__(self):
        if self.socket_ifname is not None:
            check(bool(_IFNAME.fullmatch(self.socket_ifname)), "socket_ifname",
                  "must be interface names or prefixes, comma-separated, optionally led by ^ (exclude) or = "
                  "(exact), e.g. ib0 or ^docker,lo")
        if self.ib_hca is not None:
            check(bool(_HCA.fullmatch(self.ib_hca)), "ib_hca",
                  "must be HCA names with an optional :port, comma-separated, optionally led by ^ or =, "
                  "e.g. mlx5_0,mlx5_1 or =mlx5_0:1")
        check_range(self.ib_timeout, "ib_timeout", 1, 31, note="an exponent: 4.096 us x 2^value")
        check_range(self.ib_retry_cnt, "ib_retry_cnt", 0, 7)
        check(len(self.extra) <= MAX_EXTRA, "extra", f"holds {len(self.extra)} variables; at most {MAX_EXTRA}")
        owned = {name: key for key, names in OWNED.items() for name in names}
        for name, value in self.extra.items():
            key = f"extra.{name[:60]}"
            check(bool(_NAME.fullmatch(name)), key,
                  "is not a network variable: names are upper case and start with "
                  + ", ".join(NETWORK_PREFIXES) + " (other variables do not belong to the network environment)")
            if name in owned:
                raise FieldError(key, f"is set by network.{owned[name]}: set it there")
            if isinstance(value, int):
                check_range(value, key, 0, 10**18)
            else:
                check_text(value, key, 256)


OWNED = {"socket_ifname": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"), "ib_hca": ("NCCL_IB_HCA",),
         "ib_timeout": ("NCCL_IB_TIMEOUT",), "ib_retry_cnt": ("NCCL_IB_RETRY_CNT",), "debug": ("NCCL_DEBUG",)}
"""The variables each named field sets."""


def network_env(cfg: NetworkConfig) -> dict[str, str]:
    """The variables every process of the job gets (sorted by name); empty when nothing is configured."""
    env: dict[str, str] = {}
    for key, names in OWNED.items():
        value = getattr(cfg, key)
        if value is not None:
            env.update({name: str(value) for name in names})
    env.update({name: str(value) for name, value in cfg.extra.items()})
    return dict(sorted(env.items()))


def is_network_variable(name: str) -> bool:
    """A variable of the network environment (one env-diff compares between train and rollout)."""
    return name.startswith(NETWORK_PREFIXES)

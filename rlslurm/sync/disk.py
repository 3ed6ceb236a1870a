"""Disk transport: the trainer writes safetensors (Hugging Face names) to the shared filesystem; each
engine reloads from there. The slowest transport (the lecture: 70 GB at 1 GB/s NFS = 70 s) and the
one that needs nothing shared but a directory, so it also works across torch versions.

A version becomes visible only complete: it is written under a temporary name, fsynced, and renamed
into place (`<root>/v00000012/model.safetensors`), so an engine never reads a half-written file.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from rlslurm.sync.buckets import Fault

WEIGHTS_FILE = "model.safetensors"


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def write_weights(tensors: Mapping[str, torch.Tensor], root: Path, version: int,
                  fault: Fault | None = None, keep: int = 2) -> Path:
    """Write one version atomically and prune all but the newest `keep`; returns its directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    host = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        host[name] = fault.apply(name, t) if fault else t
    save_file(host, str(tmp / WEIGHTS_FILE), metadata={"version": str(version)})
    _fsync(tmp / WEIGHTS_FILE)
    _fsync(tmp)
    if final.exists():  # a retry of the same version replaces the earlier attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    for old in sorted(p for p in root.glob("v*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one written version (the engine side of the transport)."""
    return load_file(str(Path(path) / WEIGHTS_FILE))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTransport:
    """Trainer side: write, then ask every engine (in parallel) to reload from the new directory."""

    name = "disk"

    def __init__(self, root: str | Path, *, keep: int = 2, fault: Fault | None = None):
        self.root = Path(root)
        self.keep = keep
        self.fault = fault

    def send(self, tensors: Mapping[str, torch.Tensor], engines: Sequence, version: int,
             timeout_s: float) -> int:
        path = write_weights(tensors, self.root, version, self.fault, self.keep)
        with ThreadPoolExecutor(max(1, len(engines))) as pool:
            for f in [pool.submit(e.update_disk, str(path), timeout_s) for e in engines]:
                f.result()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        pass

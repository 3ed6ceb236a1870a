"""Disk transport: the trainer writes safetensors (Hugging Face names) to the shared filesystem; each
engine reloads from there. The slowest transport (the lecture: 70 GB at 1 GB/s NFS = 70 s) and the
one that needs nothing shared but a directory, so it also works across torch versions.

A version becomes visible only complete: it is written once, straight from the tensors' memory in
1 MiB pieces (each piece checksummed for VERIFY right after it was written, while cached), as a
standard safetensors file under a temporary name, and renamed into place (`<root>/v00000012/model.safetensors`),
so an engine never reads a half-written file. Nothing is fsynced: the rename is what makes the
version atomic for readers (POSIX rename on Lustre/GPFS; NFS close-to-open consistency, as the file
is closed before the rename), and fsync would only add durability across a power loss, which a
version that lives for two syncs does not need: after a crash the job restarts its engines and
writes the version again (a retry of a version replaces it).

The engine reads the safetensors header itself and reads each tensor's bytes straight into its
slot in a landing buffer (rlslurm/sync/landing.py), checksumming each piece as it is read: one copy
out of the page cache, no temporary tensors, no mmap page faults (which cost more than the copy:
25k faults per 100 MB). It does not serve from a mapping of the file because another node may
prune the file while it is mapped.
Old versions are pruned on a background thread once the engines have loaded the new one.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import load_file

from rlslurm.sync.buckets import Entry, Fault, plan_buckets
from rlslurm.sync.checksum import PIECE_BYTES, Checksum, raw_bytes

WEIGHTS_FILE = "model.safetensors"
LANDING_BUCKET_BYTES = 16 * 2**20  # the engine reads the file in buckets of this size
# safetensors dtype names (https://huggingface.co/docs/safetensors: the header's "dtype").
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "U16": "uint16", "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}
_SAFETENSORS_DTYPES = {torch_name: name for name, torch_name in _DTYPES.items()}


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def write_weights(tensors: Mapping[str, torch.Tensor], root: Path, version: int,
                  fault: Fault | None = None, keep: int | None = 2,
                  sums: dict[str, Checksum] | None = None) -> Path:
    """Write one version atomically and prune all but the newest `keep` (None: leave them to
    `prune_versions`); returns its directory. With `sums`, checksum the tensors on the way."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_safetensors(tmp / WEIGHTS_FILE, {n: t.detach().to("cpu") for n, t in tensors.items()},
                      {"version": str(version)}, fault, sums)
    if final.exists():  # a retry of the same version replaces the earlier attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep is not None:
        prune_versions(root, keep)
    return final


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str],
                      fault: Fault | None = None, sums: dict[str, Checksum] | None = None) -> None:
    """A standard safetensors file (8-byte header size, JSON header padded to 8 bytes, the tensors'
    bytes back to back), written piece by piece from the tensors' own memory. Like safetensors'
    writer, larger dtypes first, so every tensor sits aligned to its element size in the file."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb", buffering=0) as f:
        _write_all(f, memoryview(struct.pack("<Q", len(blob)) + blob))
        for name in order:
            src = raw_bytes(tensors[name])
            data = raw_bytes(fault.apply(name, tensors[name])) if fault else src  # a corrupted copy
            check = Checksum.like(tensors[name])
            for start in range(0, src.numel(), PIECE_BYTES):
                _write_all(f, memoryview(data[start : start + PIECE_BYTES].numpy()))
                check.update(src[start : start + PIECE_BYTES])  # the trainer's own bytes, still cached
            if sums is not None:
                sums[name] = check


def _write_all(f, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += f.write(data[done:])


def prune_versions(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` version directories."""
    for old in sorted(p for p in Path(root).glob("v*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one written version, mapped from the file (not copied: read before pruning)."""
    return load_file(str(Path(path) / WEIGHTS_FILE))


def read_header(f) -> tuple[list[dict], list[tuple[int, int]]]:
    """(manifest, absolute (start, end) byte range of each tensor) of an open safetensors file."""
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])  # file order
    manifest, ranges = [], []
    for name, info in items:
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{f.name}: tensor {name!r} has dtype {info['dtype']}, which the sync does not read")
        manifest.append({"name": name, "dtype": _DTYPES[info["dtype"]], "shape": info["shape"]})
        start, end = info["data_offsets"]
        ranges.append((8 + size + start, 8 + size + end))
    return manifest, ranges


def receive(path: str | Path, landing, bucket_bytes: int = LANDING_BUCKET_BYTES) -> int:
    """Engine side: read every tensor of the version at `path` into `landing`, piece by piece, each
    piece checksummed right after it was read (staged landings); returns bytes."""
    if not landing.staged:  # in place: one load of the mapped tensors (one call into, e.g., vLLM)
        return landing.land_named(read_weights(path))
    total = 0
    with open(Path(path) / WEIGHTS_FILE, "rb", buffering=0) as f:
        manifest, ranges = read_header(f)
        where = {m["name"]: r for m, r in zip(manifest, ranges)}
        for m, (start, end) in zip(manifest, ranges):
            need = Entry(m["name"], m["dtype"], tuple(m["shape"])).nbytes
            if end - start != need:
                raise ValueError(f"{f.name}: tensor {m['name']!r} has {end - start} bytes, its shape needs {need}")

        def read(entry: Entry, start: int, out: torch.Tensor) -> None:
            _read_exactly(f, where[entry.name][0] + start, memoryview(out.numpy()))

        for i, bucket in enumerate(plan_buckets(manifest, bucket_bytes)):
            total += landing.land_pieces(i, bucket, read)
    return total


def _read_exactly(f, start: int, out: memoryview) -> None:
    done = 0
    while done < len(out):
        n = os.preadv(f.fileno(), [out[done:]], start + done)
        if n == 0:
            raise ValueError(f"{f.name}: file ends at byte {start + done}, a tensor needs {len(out) - done} more")
        done += n


class DiskTransport:
    """Trainer side: write, then ask every engine (in parallel) to reload from the new directory."""

    name = "disk"

    def __init__(self, root: str | Path, *, keep: int = 2, fault: Fault | None = None):
        self.root = Path(root)
        self.keep = keep
        self.fault = fault
        self._pruner: threading.Thread | None = None

    def send(self, tensors: Mapping[str, torch.Tensor], engines: Sequence, version: int,
             timeout_s: float, sums: dict[str, Checksum] | None = None) -> int:
        self.close()  # the last prune is done before this version's directory appears
        path = write_weights(tensors, self.root, version, self.fault, keep=None, sums=sums)
        with ThreadPoolExecutor(max(1, len(engines))) as pool:
            for f in [pool.submit(e.update_disk, str(path), timeout_s) for e in engines]:
                f.result()
        # Deleting old versions is not on the way of the new one (~10 ms per 100 MB of page cache).
        self._pruner = threading.Thread(target=prune_versions, args=(self.root, self.keep),
                                        name="sync-prune", daemon=True)
        self._pruner.start()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

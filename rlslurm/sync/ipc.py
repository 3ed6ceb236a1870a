"""IPC transport: a colocated engine maps the trainer's buckets instead of receiving a copy.

On CPU a bucket is a uint8 tensor moved into POSIX shared memory with torch's file_system strategy
(a /dev/shm file kept alive by torch_shm_manager); its handle (manager socket, file name, size) goes
to the engine as JSON, and the engine maps the same pages with `UntypedStorage._new_shared_filename_cpu`.
On GPU the bucket lives on the device and travels as a CUDA IPC handle (torch's own reduction); the
engine copies out of it on the same GPU. Either way no bytes cross a socket, and nothing is unpickled
but torch's CUDA rebuild call.

The trainer keeps its buckets alive (and reuses them next sync) until the engine confirmed the copy.

Pipelined: the update request goes out first, then the trainer fills bucket after bucket and
announces each on a FIFO of its own per engine (a 16-byte record: sync generation, bucket index);
the engine copies bucket i out while the trainer fills bucket i+1, each side checksumming as it
copies. A pipe write and read are system calls, so the bucket's bytes are visible to the engine
before the announcement is, on every architecture, without hand-made memory barriers. A trainer
that dies closes the FIFO (the engine reads end-of-file and fails); an engine that never hears
of a bucket fails after the sync's timeout.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import select
import shutil
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Mapping, Sequence

import torch

from rlslurm.sync.buckets import Fault, bucket_nbytes, flatten_into, manifest_of, plan_buckets, unflatten
from rlslurm.sync.checksum import Checksum


def share(bucket: torch.Tensor) -> dict:
    """A JSON-ready handle of a uint8 bucket that another process on this host can map."""
    if bucket.is_cuda:
        from multiprocessing.reduction import ForkingPickler
        from torch.multiprocessing.reductions import reduce_tensor

        buf = io.BytesIO()
        ForkingPickler(buf).dump(reduce_tensor(bucket))
        return {"kind": "cuda", "blob": base64.b64encode(buf.getvalue()).decode()}
    manager, name, size = bucket.untyped_storage()._share_filename_cpu_()
    return {"kind": "shm", "manager": manager.decode(), "name": name.decode(), "nbytes": int(size)}


class _TorchRebuildOnly(pickle.Unpickler):
    # A CUDA IPC handle is a pickled call of torch's rebuild function: allow torch's names only.
    def find_class(self, module, name):
        if module == "torch" or module.startswith("torch."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"an IPC handle may only reference torch, not {module}.{name}")


# Mappings kept across syncs, by handle: the trainer reuses its buckets, and mapping them afresh
# each time costs a page fault per 4 KiB page on first touch (~25k per 100 MB: more than the copy).
_attached: dict[str, torch.Tensor] = {}


def attach(handle: dict) -> torch.Tensor:
    """Map a bucket shared by `share` (engine side)."""
    key = handle.get("blob") or f"{handle['manager']}|{handle['name']}|{handle['nbytes']}"
    if key not in _attached:
        _attached[key] = _attach(handle)
    return _attached[key]


def _attach(handle: dict) -> torch.Tensor:
    if handle["kind"] == "cuda":
        rebuild, args = _TorchRebuildOnly(io.BytesIO(base64.b64decode(handle["blob"]))).load()
        return rebuild(*args)
    storage = torch.UntypedStorage._new_shared_filename_cpu(
        handle["manager"].encode(), handle["name"].encode(), int(handle["nbytes"]))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


_RECORD = struct.Struct("<QQ")  # (sync generation, bucket index): one announcement on the FIFO


def receive(manifest: list[dict], bucket_bytes: int, handles: list[dict], landing,
            ready: dict | None = None, timeout_s: float = 60.0) -> int:
    """Engine side: map each bucket and land it (`landing` copies it out, rlslurm/sync/landing.py);
    with `ready` ({"fifo", "generation"}), each bucket only once the trainer announced it."""
    buckets = plan_buckets(manifest, bucket_bytes)
    if len(buckets) != len(handles):
        raise ValueError(f"IPC update has {len(handles)} handles for {len(buckets)} buckets")
    keys = {h.get("blob") or f"{h['manager']}|{h['name']}|{h['nbytes']}" for h in handles}
    for stale in set(_attached) - keys:  # the trainer reallocated: let go of its old buckets
        del _attached[stale]
    fd = os.open(ready["fifo"], os.O_RDONLY | os.O_NONBLOCK) if ready else None
    deadline = time.monotonic() + timeout_s
    total = 0
    try:
        for i, (bucket, handle) in enumerate(zip(buckets, handles)):
            if fd is not None:
                _await(fd, int(ready["generation"]), i, deadline)
            # The landing copies the bytes out (staged) or loads them (in place): it keeps no view.
            total += landing.land(i, bucket, attach(handle)[: bucket_nbytes(bucket)])
    finally:
        if fd is not None:
            os.close(fd)
    return total


def _await(fd: int, generation: int, index: int, deadline: float) -> None:
    """Block until the trainer announces bucket `index` of sync `generation` (older records: skipped)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"ipc sync {generation}: the trainer did not announce bucket {index} in time")
        record = os.read(fd, _RECORD.size)
        if not record:
            raise ConnectionError(f"ipc sync {generation}: the trainer closed its FIFO before bucket {index}")
        got_generation, got_index = _RECORD.unpack(record)
        if got_generation < generation:
            continue  # left over from a sync that failed half-way
        if (got_generation, got_index) != (generation, index):
            raise ValueError(f"ipc sync {generation}: expected bucket {index}, the trainer announced "
                             f"bucket {got_index} of sync {got_generation}")
        return


class IpcTransport:
    """Trainer side, for engines on the same host (and GPU)."""

    name = "ipc"

    def __init__(self, *, bucket_mb: float = 64.0, device: str | None = None, fault: Fault | None = None):
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.fault = fault
        self._buffers: list[torch.Tensor] = []
        self._handles: list[dict] = []
        self._fifo_dir: str | None = None
        self._fifos: dict[str, tuple[str, int]] = {}  # engine url -> (path, write fd)
        self.generation = 0

    def _fifo(self, url: str) -> tuple[str, int]:
        if url not in self._fifos:
            if self._fifo_dir is None:
                self._fifo_dir = tempfile.mkdtemp(prefix="rlslurm-ipc-")
            path = os.path.join(self._fifo_dir, f"ready-{len(self._fifos)}")
            os.mkfifo(path, 0o600)
            # Read-write (Linux): opening does not wait for a reader, and writes never block on one.
            self._fifos[url] = (path, os.open(path, os.O_RDWR | os.O_NONBLOCK))
        return self._fifos[url]

    def _buffers_for(self, sizes: list[int]) -> list[torch.Tensor]:
        if [b.numel() for b in self._buffers] != sizes:
            # New shapes: allocate (and share) once; every later sync reuses the same pages.
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            self._handles = [share(b) for b in self._buffers]
        return self._buffers

    def send(self, tensors: Mapping[str, torch.Tensor], engines: Sequence, version: int,
             timeout_s: float, sums: dict[str, Checksum] | None = None) -> int:
        manifest = manifest_of(tensors)
        buckets = plan_buckets(manifest, self.bucket_bytes)
        buffers = self._buffers_for([bucket_nbytes(b) for b in buckets])
        self.generation += 1
        fifos = [self._fifo(e.url) for e in engines]
        with ThreadPoolExecutor(max(1, len(engines))) as pool:
            receipts = [pool.submit(e.update_ipc, manifest, self.bucket_bytes, self._handles, timeout_s,
                                    ready={"fifo": path, "generation": self.generation})
                        for e, (path, _) in zip(engines, fifos)]
            for i, (buffer, bucket) in enumerate(zip(buffers, buckets)):
                flatten_into(buffer, bucket, tensors, sums)  # and the trainer's checksums, while cached
                if self.fault:
                    for name, piece in unflatten(buffer, bucket):
                        self.fault.corrupt(name, piece.reshape(-1).view(torch.uint8))
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the engine reads in another process
                for _, fd in fifos:
                    os.write(fd, _RECORD.pack(self.generation, i))
            done, pending = wait(receipts, timeout=timeout_s)
            if pending:
                raise TimeoutError(f"{len(pending)} engines did not confirm the ipc update within {timeout_s} s")
            for f in done:
                f.result()
        return sum(b.numel() for b in buffers)

    def close(self) -> None:
        self._buffers, self._handles = [], []
        for _, fd in self._fifos.values():
            os.close(fd)
        self._fifos = {}
        if self._fifo_dir is not None:
            shutil.rmtree(self._fifo_dir, ignore_errors=True)
            self._fifo_dir = None

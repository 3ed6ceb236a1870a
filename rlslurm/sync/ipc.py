"""IPC transport: a colocated engine maps the trainer's buckets instead of receiving a copy.

On CPU a bucket is a uint8 tensor moved into POSIX shared memory with torch's file_system strategy
(a /dev/shm file kept alive by torch_shm_manager); its handle (manager socket, file name, size) goes
to the engine as JSON, and the engine maps the same pages with `UntypedStorage._new_shared_filename_cpu`.
On GPU the bucket lives on the device and travels as a CUDA IPC handle (torch's own reduction); the
engine copies out of it on the same GPU. Either way no bytes cross a socket, and nothing is unpickled
but torch's CUDA rebuild call.

The trainer keeps its buckets alive (and reuses them next sync) until the engine confirmed the copy.
"""

from __future__ import annotations

import base64
import io
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import torch

from rlslurm.sync.buckets import Fault, bucket_nbytes, flatten_into, manifest_of, plan_buckets, unflatten


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


def attach(handle: dict) -> torch.Tensor:
    """Map a bucket shared by `share` (engine side)."""
    if handle["kind"] == "cuda":
        rebuild, args = _TorchRebuildOnly(io.BytesIO(base64.b64decode(handle["blob"]))).load()
        return rebuild(*args)
    storage = torch.UntypedStorage._new_shared_filename_cpu(
        handle["manager"].encode(), handle["name"].encode(), int(handle["nbytes"]))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def receive(manifest: list[dict], bucket_bytes: int, handles: list[dict], load) -> int:
    """Engine side: map each bucket, hand its tensors to `load` (which copies), unmap."""
    buckets = plan_buckets(manifest, bucket_bytes)
    if len(buckets) != len(handles):
        raise ValueError(f"IPC update has {len(handles)} handles for {len(buckets)} buckets")
    total = 0
    for bucket, handle in zip(buckets, handles):
        flat = attach(handle)[: bucket_nbytes(bucket)]
        load(unflatten(flat, bucket))
        total += flat.numel()
        del flat
    return total


class IpcTransport:
    """Trainer side, for engines on the same host (and GPU)."""

    name = "ipc"

    def __init__(self, *, bucket_mb: float = 64.0, device: str | None = None, fault: Fault | None = None):
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.fault = fault
        self._buffers: list[torch.Tensor] = []
        self._handles: list[dict] = []

    def _buffers_for(self, sizes: list[int]) -> list[torch.Tensor]:
        if [b.numel() for b in self._buffers] != sizes:
            # New shapes: allocate (and share) once; every later sync reuses the same pages.
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            self._handles = [share(b) for b in self._buffers]
        return self._buffers

    def send(self, tensors: Mapping[str, torch.Tensor], engines: Sequence, version: int,
             timeout_s: float) -> int:
        manifest = manifest_of(tensors)
        buckets = plan_buckets(manifest, self.bucket_bytes)
        buffers = self._buffers_for([bucket_nbytes(b) for b in buckets])
        for buffer, bucket in zip(buffers, buckets):
            flatten_into(buffer, bucket, tensors)
            if self.fault:
                for name, piece in unflatten(buffer, bucket):
                    self.fault.corrupt(name, piece.reshape(-1).view(torch.uint8))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the engine reads on another stream/process
        with ThreadPoolExecutor(max(1, len(engines))) as pool:
            for f in [pool.submit(e.update_ipc, manifest, self.bucket_bytes, self._handles, timeout_s)
                      for e in engines]:
                f.result()
        return sum(b.numel() for b in buffers)

    def close(self) -> None:
        self._buffers, self._handles = [], []

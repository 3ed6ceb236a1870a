"""IPC transport: a colocated engine maps the trainer's buckets instead of receiving a copy.

On CPU a bucket is a uint8 tensor moved into POSIX shared memory with torch's file_system strategy
(a /dev/shm file kept alive by torch_shm_manager); its handle (manager socket, file name, size) goes
to the engine as JSON, and the engine maps the same pages with `UntypedStorage._new_shared_filename_cpu`.
On GPU the bucket lives on the device and travels as a CUDA IPC handle (the arguments of torch's own
reduction, as typed JSON: `encode_cuda`); the engine copies out of it on the same GPU. Either way no
bytes cross a socket, and nothing is unpickled: a handle is data, checked against a schema.

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
import json
import os
import select
import shutil
import stat
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Mapping, Sequence

import torch

from rlslurm.sync.buckets import Fault, bucket_nbytes, flatten_into, manifest_of, plan_buckets, to_dtype, unflatten
from rlslurm.sync.checksum import Checksum


def share(bucket: torch.Tensor) -> dict:
    """A JSON-ready handle of a uint8 bucket that another process on this host can map."""
    if bucket.is_cuda:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        rebuild, args = reduce_tensor(bucket)
        if rebuild is not rebuild_cuda_tensor:
            raise ValueError(f"a CUDA bucket reduced to {rebuild.__name__}, not rebuild_cuda_tensor")
        return encode_cuda(args)
    manager, name, size = bucket.untyped_storage()._share_filename_cpu_()
    return {"kind": "shm", "manager": manager.decode(), "name": name.decode(), "nbytes": int(size)}


# A CUDA handle is what torch's own reduction of a tensor returns, `(rebuild_cuda_tensor, args)`
# (torch/multiprocessing/reductions.py). Pickled, that pair is a program the receiver runs, with any
# callable the sender names. So only `args` travel, as typed JSON: classes and the dtype by name from
# allow-lists, numbers as ints, the IPC handles as base64; the engine calls rebuild_cuda_tensor itself.
CUDA_FIELDS = ("tensor_cls", "size", "stride", "tensor_offset", "storage_cls", "dtype", "device", "handle",
               "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
               "ref_counter_offset", "event_handle", "event_sync_required")
"""rebuild_cuda_tensor's parameters, in order (torch 2.13)."""
_TENSOR_CLASSES = {"Tensor": torch.Tensor}
_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}
_BYTES = ("handle", "ref_counter_handle", "event_handle")
_INTS = ("tensor_offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")


def _name_of(table: dict, value, what: str) -> str:
    for name, cls in table.items():
        if value is cls:
            return name
    raise ValueError(f"a CUDA IPC handle's {what} is {value!r}, not one of {', '.join(table)}")


def encode_cuda(args: tuple) -> dict:
    """rebuild_cuda_tensor's args as a JSON-ready dict (kind "cuda")."""
    if len(args) != len(CUDA_FIELDS):
        raise ValueError(f"rebuild_cuda_tensor takes {len(CUDA_FIELDS)} args, reduce_tensor gave {len(args)}")
    a = dict(zip(CUDA_FIELDS, args))
    dtype = str(a["dtype"]).removeprefix("torch.")
    to_dtype(dtype)  # on the allow-list
    out = {"kind": "cuda", "tensor_cls": _name_of(_TENSOR_CLASSES, a["tensor_cls"], "tensor class"),
           "storage_cls": _name_of(_STORAGE_CLASSES, a["storage_cls"], "storage class"), "dtype": dtype,
           "size": [int(d) for d in a["size"]], "stride": [int(d) for d in a["stride"]],
           "requires_grad": bool(a["requires_grad"]), "event_sync_required": bool(a["event_sync_required"])}
    out.update({k: int(a[k]) for k in _INTS})
    out.update({k: None if a[k] is None else base64.b64encode(bytes(a[k])).decode() for k in _BYTES})
    return out


def decode_cuda(handle: dict) -> tuple:
    """The args of rebuild_cuda_tensor from `encode_cuda`'s dict; ValueError for anything off the schema."""
    extra = set(handle) - {"kind", *CUDA_FIELDS}
    if extra or handle.get("kind") != "cuda":
        raise ValueError(f"not a CUDA IPC handle: kind {handle.get('kind')!r}, unknown fields {sorted(extra)}")
    a: dict = {}
    a["tensor_cls"] = _TENSOR_CLASSES.get(handle["tensor_cls"])
    a["storage_cls"] = _STORAGE_CLASSES.get(handle["storage_cls"])
    if a["tensor_cls"] is None or a["storage_cls"] is None:
        raise ValueError(f"a CUDA IPC handle names classes {handle['tensor_cls']!r} / {handle['storage_cls']!r}")
    a["dtype"] = to_dtype(handle["dtype"])
    for key in ("size", "stride"):
        if not isinstance(handle[key], list) or not all(type(d) is int and d >= 0 for d in handle[key]):
            raise ValueError(f"a CUDA IPC handle's {key} must be a list of ints >= 0")
    a["size"], a["stride"] = torch.Size(handle["size"]), tuple(handle["stride"])
    for key in _INTS:
        if type(handle[key]) is not int or handle[key] < 0:
            raise ValueError(f"a CUDA IPC handle's {key} must be an int >= 0, not {handle[key]!r}")
        a[key] = handle[key]
    for key in ("requires_grad", "event_sync_required"):
        if type(handle[key]) is not bool:
            raise ValueError(f"a CUDA IPC handle's {key} must be a bool")
        a[key] = handle[key]
    for key in _BYTES:
        value = handle[key]
        if value is None and key == "event_handle":
            a[key] = None
            continue
        if not isinstance(value, str):
            raise ValueError(f"a CUDA IPC handle's {key} must be base64 text")
        a[key] = base64.b64decode(value, validate=True)
    return tuple(a[k] for k in CUDA_FIELDS)


def _key(handle: dict) -> str:
    return json.dumps(handle, sort_keys=True)


# Mappings kept across syncs, by handle: the trainer reuses its buckets, and mapping them afresh
# each time costs a page fault per 4 KiB page on first touch (~25k per 100 MB: more than the copy).
_attached: dict[str, torch.Tensor] = {}


def attach(handle: dict) -> torch.Tensor:
    """Map a bucket shared by `share` (engine side)."""
    key = _key(handle)
    if key not in _attached:
        _attached[key] = _attach(handle)
    return _attached[key]


def _attach(handle: dict) -> torch.Tensor:
    if handle["kind"] == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = decode_cuda(handle)
        try:
            return rebuild_cuda_tensor(*args)
        except (RuntimeError, AssertionError) as e:  # no CUDA here (torch asserts), a stale or foreign handle
            raise ValueError(f"cannot map a CUDA IPC handle: {type(e).__name__}: {e}") from None
    try:
        storage = torch.UntypedStorage._new_shared_filename_cpu(
            handle["manager"].encode(), handle["name"].encode(), int(handle["nbytes"]))
    except RuntimeError as e:  # no such segment (a trainer gone, a made-up handle): the update is refused
        raise ValueError(f"cannot map shared memory {handle['name']}: {e}") from None
    return torch.empty(0, dtype=torch.uint8).set_(storage)


_RECORD = struct.Struct("<QQ")  # (sync generation, bucket index): one announcement on the FIFO


def receive(manifest: list[dict], bucket_bytes: int, handles: list[dict], landing,
            ready: dict | None = None, timeout_s: float = 60.0) -> int:
    """Engine side: map each bucket and land it (`landing` copies it out, rlslurm/sync/landing.py);
    with `ready` ({"fifo", "generation"}), each bucket only once the trainer announced it."""
    buckets = plan_buckets(manifest, bucket_bytes)
    if len(buckets) != len(handles):
        raise ValueError(f"IPC update has {len(handles)} handles for {len(buckets)} buckets")
    keys = {_key(h) for h in handles}
    for stale in set(_attached) - keys:  # the trainer reallocated: let go of its old buckets
        del _attached[stale]
    fd = _open_fifo(ready["fifo"]) if ready else None
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


def _open_fifo(path: str) -> int:
    """The trainer's announcement FIFO, opened for reading; ValueError for a path that is no FIFO (opening
    some device files has effects of its own, so the type is checked before and after the open)."""
    if not stat.S_ISFIFO(os.lstat(path).st_mode):
        raise ValueError(f"ipc sync: {path} is not a FIFO")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"ipc sync: {path} is not a FIFO")
    return fd


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

"""The wire format shared by the broadcast and IPC transports: a manifest and byte buckets.

The trainer describes what it sends in a manifest (name, dtype, shape, in order); both sides derive
the same bucket plan from it, so only raw bytes travel. A bucket is the bytes of consecutive
tensors concatenated (any mix of dtypes: each tensor is viewed as uint8), at most `bucket_bytes`
long unless one tensor alone is larger. Fewer, larger messages are what makes a broadcast fast.

`flatten_into` can take the trainer's checksums on the way: each tensor is copied in 1 MiB pieces
and each piece of the trainer's own tensor is checksummed right after it was copied, while cached.

`Fault` is the test hook that corrupts one tensor in flight, after its checksum was taken, so that
VERIFY can be seen to catch it (RLSLURM_SYNC_CORRUPT=name[:times] sets it from the environment).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch

from rlslurm.sync.checksum import PIECE_BYTES, Checksum, raw_bytes

CORRUPT_ENV = "RLSLURM_SYNC_CORRUPT"


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=to_dtype(self.dtype)).element_size()


DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64", "int32",
          "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool")
"""The dtypes a manifest may name (by torch's name, without `torch.`): an allow-list, not getattr(torch, x)."""


def to_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} in a sync manifest is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def manifest_of(tensors: Mapping[str, torch.Tensor]) -> list[dict]:
    """JSON-ready manifest: [{"name", "dtype", "shape"}] in the order the tensors will travel."""
    return [
        {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for n, t in tensors.items()
    ]


def entries(manifest: list[dict]) -> list[Entry]:
    return [Entry(m["name"], m["dtype"], tuple(int(d) for d in m["shape"])) for m in manifest]


ALIGN_BYTES = 16  # every tensor starts aligned in its bucket, so a byte slice can be viewed as any dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class Bucket:
    entries: tuple[Entry, ...]
    offsets: tuple[int, ...]
    nbytes: int


def plan_buckets(manifest: list[dict], bucket_bytes: int) -> list[Bucket]:
    """Group manifest entries, in order, into buckets of at most bucket_bytes (a larger tensor alone)."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for entry in entries(manifest):
        need = _aligned(size) + entry.nbytes
        if groups[-1] and need > bucket_bytes:
            groups.append([])
            need = entry.nbytes
        groups[-1].append(entry)
        size = need
    buckets = []
    for group in groups:
        offsets, end = [], 0
        for e in group:
            offsets.append(_aligned(end))
            end = offsets[-1] + e.nbytes
        buckets.append(Bucket(tuple(group), tuple(offsets), end))
    return [b for b in buckets if b.entries]


def bucket_nbytes(bucket: Bucket) -> int:
    return bucket.nbytes


bytes_of = raw_bytes  # the tensor's bytes as a flat uint8 view (a copy only if not contiguous)


def flatten_into(out: torch.Tensor, bucket: Bucket, tensors: Mapping[str, torch.Tensor],
                 sums: dict[str, Checksum] | None = None) -> torch.Tensor:
    """Copy the bucket's tensors, as bytes, into the uint8 tensor `out` (shared memory or device);
    with `sums`, also checksum each source tensor piece by piece as it is copied."""
    for e, offset in zip(bucket.entries, bucket.offsets):
        src, dst = bytes_of(tensors[e.name]), out[offset : offset + e.nbytes]
        if sums is None:
            dst.copy_(src)
            continue
        check = sums[e.name] = Checksum.like(tensors[e.name])
        for start in range(0, e.nbytes, PIECE_BYTES):
            piece = src[start : start + PIECE_BYTES]
            dst[start : start + PIECE_BYTES].copy_(piece)
            check.update(piece)
    return out


def unflatten(flat: torch.Tensor, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of the tensors inside one received bucket (no copy; copy before the bucket is reused)."""
    for e, offset in zip(bucket.entries, bucket.offsets):
        dtype = to_dtype(e.dtype)
        if not e.nbytes:
            yield e.name, torch.empty(e.shape, dtype=dtype, device=flat.device)
            continue
        yield e.name, flat[offset : offset + e.nbytes].view(dtype).view(e.shape)


@dataclass
class Fault:
    """Corrupt tensor `tensor` in flight the next `times` syncs (a test hook; never set in production)."""

    tensor: str
    times: int = 1 << 30
    hits: int = field(default=0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Fault | None":
        value = (os.environ if env is None else env).get(CORRUPT_ENV, "")
        if not value:
            return None
        name, _, times = value.partition(":")
        return cls(name, int(times) if times else 1 << 30)

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, or a corrupted copy of it if it is the one (the trainer's own tensor stays intact)."""
        if name != self.tensor or self.hits >= self.times:
            return tensor
        copy = tensor.detach().clone()
        self.corrupt(name, copy.reshape(-1).view(torch.uint8))
        return copy

    def corrupt(self, name: str, data: torch.Tensor) -> bool:
        """Flip the low bit of the first byte of `data` (a uint8 view of the tensor) if it is the one."""
        if name != self.tensor or self.hits >= self.times or data.numel() == 0:
            return False
        self.hits += 1
        data[0] ^= 1
        return True

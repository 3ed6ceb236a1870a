"""Broadcast transport: one process group spanning trainer rank 0 (rank 0 here) and every engine.

The group is built by hand, apart from any default group either side already has (a process cannot
`init_process_group` twice): the job's store hosted by the trainer (rlslurm/jobstore.py: bound to the trainer's
address only, joined only by a process that proves the job's secret) plus `ProcessGroupGloo(store, rank,
world)` on CPU, or `ProcessGroupNCCL` on GPU — the same code. Weights travel in buckets of
`sync.bucket_mb` (tensors flattened to bytes, one broadcast per bucket, landed on the engine).

Pipelined: both sides keep `PIPELINE_DEPTH` broadcasts in flight (async work handles). The trainer
flattens bucket i+1 while bucket i is on the wire (a bucket of one tensor is sent from the tensor
itself, no flatten); the engine receives bucket i+1 while bucket i is checksummed (rlslurm/sync/
landing.py). Every collective has the group's timeout, so a dead engine raises instead of hanging;
after any failure the group is dropped and rebuilt at the next sync.

Trainer: `BroadcastTransport(host, bucket_mb=64).send(tensors, engines, version, timeout_s)`.
Engine:  `group = BroadcastGroup.join(addr, port, rank, world, timeout_s, token=...)`, then `receive(...)`.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from rlslurm.sync.buckets import Bucket, Fault, bytes_of, flatten_into, manifest_of, plan_buckets, unflatten
from rlslurm.sync.checksum import Checksum

log = logging.getLogger(__name__)

PIPELINE_DEPTH = 4
"""Broadcasts in flight per side: queued back to back on the wire while the trainer flattens the next
bucket and the engine checksums the last one (one send buffer per slot on the trainer)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BroadcastGroup:
    """A process group of its own (rank 0 = the trainer), for weight broadcasts only."""

    def __init__(self, pg, store, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.pg, self.store = pg, store  # held: the group calls a Python store (rlslurm/jobstore.py) it does not own
        self.rank, self.world_size = rank, world_size
        self.device, self.timeout_s = device, timeout_s

    @classmethod
    def join(cls, addr: str, port: int, rank: int, world_size: int, timeout_s: float,
             device: str | None = None, generation: int = 0, token: str | None = None) -> "BroadcastGroup":
        """Rendezvous with all `world_size` members; blocks until they all join or timeout_s passes. `token`: the
        job's secret (default: jobstore.job_token()), which every member proves to the store rank 0 hosts."""
        from rlslurm.jobstore import job_token, rendezvous_store

        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = rendezvous_store(addr, port, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                 token=job_token(token))
        # A fresh prefix per generation: a rebuilt group must not read the keys of a broken one.
        prefixed = dist.PrefixStore(f"rlslurm-sync-{generation}", store)
        if dev.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        return cls(pg, store, rank, world_size, dev, timeout_s)

    def broadcast_async(self, tensor: torch.Tensor):
        """Start a broadcast from rank 0 into `tensor` on every rank; `.wait()` on the result."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.broadcast_async(tensor).wait()

    def receive(self, manifest: list[dict], bucket_bytes: int, landing) -> int:
        """Engine side: receive every bucket into `landing` (rlslurm/sync/landing.py); returns bytes.

        Bucket i+1 is already being received while bucket i is landed and checksummed.
        """
        in_flight: deque = deque()
        total = 0
        for i, bucket in enumerate(plan_buckets(manifest, bucket_bytes)):
            flat = landing.buffer(i, bucket.nbytes, device=self.device)
            in_flight.append((i, bucket, flat, self.broadcast_async(flat)))
            if len(in_flight) >= PIPELINE_DEPTH:
                total += _land(landing, *in_flight.popleft())
        while in_flight:
            total += _land(landing, *in_flight.popleft())
        return total


def _land(landing, index: int, bucket: Bucket, flat: torch.Tensor, work) -> int:
    work.wait()
    return landing.land(index, bucket, flat)


class BroadcastTransport:
    """Trainer side. `on_bucket(i)` runs after bucket i went out (a test hook for mid-transfer faults)."""

    name = "broadcast"

    def __init__(self, host: str = "127.0.0.1", *, bucket_mb: float = 64.0, port: int | None = None,
                 fault: Fault | None = None, on_bucket: Callable[[int], None] | None = None):
        self.host, self.port = host, port
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.fault, self.on_bucket = fault, on_bucket
        self.group: BroadcastGroup | None = None
        self._buffers: list[torch.Tensor] = []  # PIPELINE_DEPTH send buffers, kept warm across syncs
        self.generation = 0
        self._members: tuple[str, ...] = ()

    def _connect(self, engines: Sequence, timeout_s: float) -> BroadcastGroup:
        urls = tuple(e.url for e in engines)
        if self.group is not None and urls == self._members:
            return self.group
        self.close()
        port = self.port or free_port(self.host)
        # An engine is `group_ranks` members (vLLM's server: one per tensor-parallel worker, each receives the
        # whole tensors and loads its shard), from its first rank on; rlslurm's own server is one.
        sizes = [getattr(e, "group_ranks", 1) for e in engines]
        firsts = [1 + sum(sizes[:i]) for i in range(len(engines))]
        world = 1 + sum(sizes)
        self.generation += 1
        log.info("building the sync group: %d engines (%d ranks), store %s:%d, timeout %.0f s",
                 len(engines), world - 1, self.host, port, timeout_s)
        # The engines hold the job's secret (their clients send it): the trainer proves the same one to its store.
        token = next((e.token for e in engines if getattr(e, "token", None)), None)
        with ThreadPoolExecutor(len(engines)) as pool:
            joins = [pool.submit(e.broadcast_join, self.host, port, first, world, self.generation, timeout_s)
                     for first, e in zip(firsts, engines)]
            group = BroadcastGroup.join(self.host, port, 0, world, timeout_s, generation=self.generation, token=token)
            for f in joins:
                f.result()
        self.group, self._members = group, urls
        return group

    def send(self, tensors: Mapping[str, torch.Tensor], engines: Sequence, version: int,
             timeout_s: float, sums: dict[str, Checksum] | None = None) -> int:
        try:
            return self._send(tensors, engines, timeout_s, sums)
        except BaseException:
            self.close()  # a group that saw a failure is in an unknown state: rebuild next time
            raise

    def _send(self, tensors, engines, timeout_s, sums) -> int:
        group = self._connect(engines, timeout_s)
        manifest = manifest_of(tensors)
        buckets = plan_buckets(manifest, self.bucket_bytes)
        total = 0
        with ThreadPoolExecutor(len(engines)) as pool:
            receipts = [pool.submit(e.update_broadcast, manifest, self.bucket_bytes, timeout_s) for e in engines]
            in_flight: deque = deque()
            for i, bucket in enumerate(buckets):
                if len(in_flight) >= PIPELINE_DEPTH:
                    self._sent(*in_flight.popleft())
                flat = self._flat(bucket, tensors, i % PIPELINE_DEPTH, group.device, sums)
                in_flight.append((i, group.broadcast_async(flat)))
                total += flat.numel()
            while in_flight:
                self._sent(*in_flight.popleft())
            done, pending = wait(receipts, timeout=timeout_s)
            if pending:
                raise TimeoutError(f"{len(pending)} engines did not confirm the broadcast within {timeout_s} s")
            for f in done:
                f.result()
        return total

    def _sent(self, index: int, work) -> None:
        work.wait()
        if self.on_bucket:
            self.on_bucket(index)

    def _flat(self, bucket: Bucket, tensors, slot: int, device: torch.device, sums) -> torch.Tensor:
        """The bytes of one bucket: the tensor itself if it is alone (and not to be corrupted),
        else flattened into send buffer `slot` (free again: its last broadcast was waited for).
        Checksums of the trainer's tensors go into `sums` meanwhile (earlier buckets are on the wire)."""
        (first, *rest) = bucket.entries
        lone = tensors[first.name]
        if not rest and lone.device == device and lone.is_contiguous() and not (
                self.fault and self.fault.tensor == first.name):
            if sums is not None:
                sums[first.name] = Checksum.like(lone).update(bytes_of(lone))
            return bytes_of(lone)
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._buffers[slot].numel() < bucket.nbytes or self._buffers[slot].device != device:
            self._buffers[slot] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        flat = flatten_into(self._buffers[slot][: bucket.nbytes], bucket, tensors, sums)
        if self.fault:
            for name, piece in unflatten(flat, bucket):
                self.fault.corrupt(name, piece.reshape(-1).view(torch.uint8))
        return flat

    def close(self) -> None:
        if self.group is not None:
            # Let go of the group without a collective shutdown: a peer may be dead.
            self.group = None
            self._members = ()
        self._buffers = []

"""The engine side of one weight update: where its tensors land between UPDATE and VERIFY.

The engine server opens a `Landing` when an update starts; the transport's receive code hands it
one bucket at a time (rlslurm/sync/{broadcast,ipc,disk}.py); VERIFY compares `landing.checksums`
with the trainer's; `commit()` or `drop()` ends it. Two modes:

staged (the engine `adopts_weights` and the server keeps a rollback): every bucket lands in a buffer
  of the landing's own (broadcast receives straight into it; ipc and disk copy into it from shared
  memory or the file), its tensors are checksummed there, and after VERIFY passed `commit()` hands
  views of those buffers to the engine by reference. The served tensors are not touched before the
  commit, so a half-updated model is never served and a failed VERIFY is undone by dropping the
  landing: no snapshot, no copy back. The buffers that a commit retires are landed in by the next
  update (`BufferPool`): two sets of weight memory in turn, as with the host snapshot this
  replaces, but no copy per sync. Checksums are taken as the tensors land: a copied tensor piece by
  piece right after each piece is copied (still in cache), a received bucket while the transport
  receives the next one. VERIFY then only compares strings.
in place (other engines, e.g. vLLM, or --no-keep-previous): each bucket is loaded into the served
  tensors (`engine.load_weights`) as it lands; `checksums` is None and VERIFY asks the engine
  (`engine.checksums()`, which for vLLM reads what its worker process really serves); the server
  snapshots first if it keeps a rollback.

    landing = Landing(engine, staged=True, pool=pool)
    flat = landing.buffer(i, bucket.nbytes); <receive into flat>; landing.land(i, bucket, flat)
    landing.finish()                         # the checksums as strings; the end of UPDATE
    compare(expected, landing.checksums)     # VERIFY
    landing.commit()                         # or landing.drop()
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Protocol

import torch

from rlslurm.sync.broadcast import PIPELINE_DEPTH
from rlslurm.sync.buckets import Bucket, Entry, manifest_of, plan_buckets, unflatten
from rlslurm.sync.checksum import PIECE_BYTES, Checksum, finish as finish_checksums, raw_bytes

SCRATCH_SLOTS = PIPELINE_DEPTH  # in place: buckets the broadcast receives ahead of the one it lands
LANDED_BUCKET_BYTES = 16 * 2**20  # staged: buffer size for tensors that arrive one by one


class WeightLoadError(ValueError):
    """An update names a tensor the engine does not serve, or gives it the wrong shape or dtype."""


class Engine(Protocol):
    """What a landing uses of the engine it lands on (rlslurm/rollout/engine.py's Engine has it all; vLLM's
    worker-side model in rollout/vllm_transfer.py the in-place part)."""

    model_name: str
    adopts_weights: bool

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> object: ...

    def adopt_weights(self, named: dict[str, torch.Tensor]) -> object: ...


class BufferPool:
    """Weight memory of an engine that stages updates: the buckets it serves from, and spare ones.

    Lifecycle: a landing `take`s spare buffers (or allocates); `commit` makes its buffers the served
    set and the previously served set the spare one; `drop` makes its buffers spare. Only one spare
    set is kept, so memory stays at two versions of the weights. An update of some tensors only (train.lora:
    the adapters, after a first sync of everything) retires only the served buffers none of whose tensors is
    still served: a buffer that holds the frozen base stays served, however many adapter updates follow.
    """

    def __init__(self) -> None:
        self.serving: list[torch.Tensor] = []
        self._spare: list[torch.Tensor] = []
        self._held: list[set[str] | None] = []  # per serving buffer: the names still served from it (None: all)

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        for k, buf in enumerate(self._spare):
            if buf.numel() == nbytes and buf.device == device:
                return self._spare.pop(k)  # already faulted in: no page faults, no allocator call
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def commit(self, buffers: list[torch.Tensor], names: list[set[str]] | None = None,
               served: set[str] | None = None) -> None:
        """`buffers` serve from now on. `names`: each one's tensors, and `served`: every name the engine serves;
        given both and the update does not replace every served tensor, only wholly replaced buffers retire."""
        if names is None or served is None or set().union(*names) >= served:
            self._spare, self.serving, self._held = self.serving, list(buffers), [None] * len(buffers)
            return
        replaced = set().union(*names)
        kept, held, retired = [], [], []
        for buf, left in zip(self.serving, self._held):
            left = (served if left is None else left) - replaced
            (kept if left else retired).append(buf)
            if left:
                held.append(left)
        self._spare, self.serving, self._held = retired, kept + list(buffers), held + [set(n) for n in names]

    def drop(self, buffers: list[torch.Tensor]) -> None:
        self._spare = list(buffers)

    @property
    def spare_bytes(self) -> int:
        return sum(b.numel() for b in self._spare)


Fill = Callable[[Entry, int, torch.Tensor], None]
"""fill(entry, start, out): write bytes [start, start + len(out)) of tensor `entry` into uint8 `out`."""


class Landing:
    """One update's tensors on an engine, from the first bucket to commit or drop."""

    def __init__(self, engine: Engine, *, staged: bool, pool: BufferPool | None = None):
        if staged and not engine.adopts_weights:
            raise ValueError(f"{type(engine).__name__} cannot adopt weights: use staged=False")
        self.engine, self.staged = engine, staged
        self.pool = pool if pool is not None else BufferPool()
        # Staged only: named_weights() may be a costly read-back for an engine that cannot adopt.
        self.served = dict(engine.named_weights()) if staged else {}
        self.device = next(iter(self.served.values())).device if self.served else torch.device("cpu")
        self.tensors: dict[str, torch.Tensor] = {}  # staged: name -> view into one of self.buffers
        self.buffers: dict[int, torch.Tensor] = {}  # staged: bucket index -> its buffer
        self.names: dict[int, set[str]] = {}  # staged: bucket index -> the tensors it holds
        self.sums: dict[str, Checksum] = {}
        self.checksums: dict[str, str] | None = {} if staged else None
        self.bytes = 0
        self._scratch: list[torch.Tensor] = []
        self.open = True

    # -- receiving ---------------------------------------------------------------------------------
    def buffer(self, index: int, nbytes: int, device: torch.device | None = None) -> torch.Tensor:
        """A uint8 buffer for bucket `index` to be received into directly (then `land` it).

        Staged: the bucket's own buffer, kept and later served, on the served weights' device. In place:
        one of a few scratch buffers taken in turn (a transport may have up to SCRATCH_SLOTS buckets in
        flight), on `device`, the transport's: an engine whose weights live in another process (vLLM's
        worker) has no device of its own here, and NCCL receives only into GPU memory.
        """
        if self.staged:
            if index not in self.buffers:
                self.buffers[index] = self.pool.take(nbytes, self.device)
            return self.buffers[index]
        device = device or self.device
        slot = index % SCRATCH_SLOTS
        while len(self._scratch) <= slot:
            self._scratch.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._scratch[slot].numel() < nbytes or self._scratch[slot].device != device:
            self._scratch[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._scratch[slot][:nbytes]

    def land(self, index: int, bucket: Bucket, flat: torch.Tensor) -> int:
        """Bucket `index` arrived as the bytes `flat`: the landing's own buffer (received into), or
        a foreign one (shared memory), copied piece by piece. Returns its bytes."""
        if not self.staged:
            return self._load(dict(unflatten(flat, bucket)))
        if flat.data_ptr() == self.buffer(index, bucket.nbytes).data_ptr():
            named = dict(unflatten(flat, bucket))
            self._check(named)
            for name, t in named.items():
                self.sums[name] = Checksum.like(t).update(raw_bytes(t))
            return self._stage(named)

        offsets = {e.name: offset for e, offset in zip(bucket.entries, bucket.offsets)}

        def copy(entry: Entry, start: int, out: torch.Tensor) -> None:
            at = offsets[entry.name] + start
            out.copy_(flat[at : at + out.numel()])

        return self.land_pieces(index, bucket, copy)

    def land_pieces(self, index: int, bucket: Bucket, fill: Fill) -> int:
        """Bucket `index` written by `fill`, tensor by tensor, PIECE_BYTES at a time; each piece is
        checksummed right after it is written (staged), or the bucket is loaded (in place)."""
        own = self.buffer(index, bucket.nbytes)
        host = own if own.device.type == "cpu" else torch.empty(PIECE_BYTES, dtype=torch.uint8)
        named = dict(unflatten(own, bucket))
        if self.staged:
            self._check(named)
        for e, offset in zip(bucket.entries, bucket.offsets):
            check = Checksum.like(named[e.name]) if self.staged else None  # in place: VERIFY asks the engine
            for start in range(0, e.nbytes, PIECE_BYTES):
                piece = own[offset + start : offset + min(e.nbytes, start + PIECE_BYTES)]
                if host is own:
                    fill(e, start, piece)
                else:
                    fill(e, start, host[: piece.numel()])
                    piece.copy_(host[: piece.numel()])
                if check is not None:
                    check.update(piece)
            if check is not None:
                self.sums[e.name] = check
        return self._stage(named) if self.staged else self._load(named)

    def land_named(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Separate tensors (e.g. views of an mmapped file). In place: one `load_weights` call;
        staged: copied into buffers of LANDED_BUCKET_BYTES, checksummed piece by piece."""
        if not self.staged:
            return self._load(dict(tensors))
        total = 0
        for i, bucket in enumerate(plan_buckets(manifest_of(tensors), LANDED_BUCKET_BYTES)):
            def copy(entry: Entry, start: int, out: torch.Tensor) -> None:
                out.copy_(raw_bytes(tensors[entry.name])[start : start + out.numel()])

            total += self.land_pieces(i, bucket, copy)
        return total

    def _stage(self, named: dict[str, torch.Tensor]) -> int:
        self.tensors.update(named)
        for index, buf in self.buffers.items():  # which bucket these views are of
            if named and next(iter(named.values())).untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                self.names.setdefault(index, set()).update(named)
        return self._count(named)

    def _load(self, named: dict[str, torch.Tensor]) -> int:
        self.engine.load_weights(named.items())
        return self._count(named)

    def _count(self, named: Mapping[str, torch.Tensor]) -> int:
        n = sum(t.numel() * t.element_size() for t in named.values())
        self.bytes += n
        return n

    def _check(self, named: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in named.items():
            target = self.served.get(name)
            if target is None:
                raise WeightLoadError(f"engine {self.engine.model_name} serves no tensor named {name!r}")
            if tuple(target.shape) != tuple(tensor.shape) or target.dtype != tensor.dtype:
                raise WeightLoadError(f"tensor {name!r}: engine has {target.dtype} {tuple(target.shape)}, "
                                      f"update has {tensor.dtype} {tuple(tensor.shape)}")

    def finish(self) -> int:
        """The landed tensors' checksums as strings (the end of UPDATE); returns the bytes landed."""
        if self.staged and self.sums:
            self.checksums.update(finish_checksums(self.sums))
            self.sums = {}
        return self.bytes

    # -- after VERIFY --------------------------------------------------------------------------------
    def commit(self) -> None:
        """Serve what landed. Staged: swap the views in by reference (all or none, under the
        engine's lock); the served set this retires becomes the next update's spare buffers."""
        if self.staged and self.open:
            self.engine.adopt_weights(self.tensors)
            order = sorted(self.buffers)
            self.pool.commit([self.buffers[i] for i in order], [self.names.get(i, set()) for i in order],
                             set(self.served))
        self._close()

    def drop(self) -> None:
        """Discard what landed (staged: the served weights were never touched)."""
        if self.staged and self.open:
            self.pool.drop([self.buffers[i] for i in sorted(self.buffers)])
        self._close()

    def _close(self) -> None:
        self.open = False
        self.tensors, self.buffers, self.sums, self._scratch, self.names = {}, {}, {}, [], {}

"""Disk transport: the trainer writes safetensors (Hugging Face names) to the shared filesystem; each
engine reloads from there. The slowest transport (the lecture: 70 GB at 1 GB/s NFS = 70 s) and the
one that needs nothing shared but a directory, so it also works across torch versions.

A version is Hugging Face's sharded layout (`<root>/v00000012/model-00001-of-00007.safetensors` ...
plus `model.safetensors.index.json`; one shard is a plain `model.safetensors`), shards of `sync.bucket_mb`
in the tensors' own order (a model's layer by layer). Pipelined: an engine that takes shards one at a time
(vLLM's server: /start_weight_update, one /update_weights per shard, /finish_weight_update) is told about
shard k as soon as it is complete and loads it while shard k + 1 is written; another engine (rlslurm's
transformers server) reloads the whole version once written. Crash safety: each shard is written once,
straight from the tensors' memory in 1 MiB pieces (each piece checksummed for VERIFY right after it was
written, while cached), under a temporary name, and renamed when complete, so an engine is never told
about, nor reads, a half-written shard; the whole version is written in a temporary directory that gets
its version's name only after every shard, the index, and every engine's load (`v00000012`); the weights
are served only after VERIFY (rlslurm/sync/protocol.py). Nothing is fsynced: the renames are what make
shards and versions atomic for readers (POSIX rename on Lustre/GPFS; NFS close-to-open consistency, as a
file is closed before its rename), and fsync would only add durability across a power loss, which a
version that lives for two syncs does not need: after a crash the job restarts its engines and writes
the version again (a retry of a version replaces it).

rlslurm's transformers server reads the safetensors header itself and reads each tensor's bytes straight into its
slot in a landing buffer (rlslurm/sync/landing.py), checksumming each piece as it is read: one copy
out of the page cache, no temporary tensors, no mmap page faults (which cost more than the copy:
25k faults per 100 MB). It does not serve from a mapping of the file because another node may
prune the file while it is mapped. vLLM's workers map each shard and hand its tensors to the model's own
`load_weights`, which copies them into vLLM's parameters (rollout/vllm_transfer.py).
Old versions are pruned on a background thread once the engines have loaded the new one.

What an engine reads is named by a request (/admin/update/disk, vLLM's /update_weights), so each file is opened
as one that may be hostile (`open_regular`): not through a link, only a regular file (a FIFO would block the
read, /dev/zero or a huge file would fill memory: the old server answered 500 MemoryError), an index of at most
MAX_INDEX_BYTES and a safetensors header of at most MAX_HEADER_BYTES, both read as bounded JSON, and shard names
that are plain file names of the version's directory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from safetensors.torch import load_file

from rlslurm import safejson
from rlslurm.sync.buckets import Entry, Fault, plan_buckets
from rlslurm.sync.checksum import PIECE_BYTES, Checksum, raw_bytes

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
"""Hugging Face's index of a sharded checkpoint: {"metadata": {"total_size"}, "weight_map": {name: file}}."""
LANDING_BUCKET_BYTES = 16 * 2**20  # the engine reads the file in buckets of this size
SHARD_BYTES = 16 * 2**20
"""Bytes per shard file (sync.bucket_mb sets it): the unit an engine loads while the next one is written."""
# safetensors dtype names (https://huggingface.co/docs/safetensors: the header's "dtype").
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "U16": "uint16", "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}
_SAFETENSORS_DTYPES = {torch_name: name for name, torch_name in _DTYPES.items()}

MAX_INDEX_BYTES = 64 << 20
"""Largest model.safetensors.index.json read (10^5 tensors' names: a few MB)."""
MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header read: the safetensors library's own limit."""
SHARD_NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}\.safetensors$")
"""A shard is a plain file of the version's directory: no path separator, no `..`."""

OnShard = Callable[[Path, str], None]
"""on_shard(directory, file name): a shard is complete in `directory` (still the version's temporary one)."""


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def plan_shards(tensors: Mapping[str, torch.Tensor], shard_bytes: int | None) -> list[tuple[str, list[str]]]:
    """[(file name, tensor names)] in the tensors' own order (a model's layer by layer, so a layer is usually
    complete within one shard), each shard up to `shard_bytes` (a larger tensor alone); one shard is the
    unsharded `model.safetensors`, more follow Hugging Face's `model-00001-of-00003.safetensors`."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shard_bytes and groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return [(WEIGHTS_FILE, groups[0])]
    return [(f"model-{k:05d}-of-{len(groups):05d}.safetensors", g) for k, g in enumerate(groups, 1)]


def write_weights(tensors: Mapping[str, torch.Tensor], root: Path, version: int,
                  fault: Fault | None = None, keep: int | None = 2,
                  sums: dict[str, Checksum] | None = None, shard_bytes: int | None = None,
                  on_shard: OnShard | None = None, settle: Callable[[], None] | None = None) -> Path:
    """Write one version atomically and prune all but the newest `keep` (None: leave them to
    `prune_versions`); returns its directory. With `sums`, checksum the tensors on the way.

    Sharded (`shard_bytes`): each shard is written under a temporary name and renamed when complete, then
    `on_shard` is told (an engine may load it while the next one is written: a shard it is told about is
    whole); the index goes last, then `settle` (waits for the engines still loading from the temporary
    directory), and only then does the directory get its version's name. A failure removes the directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    shards = plan_shards(tensors, shard_bytes)
    weight_map, total = {}, 0
    try:
        for file, names in shards:
            part = {n: tensors[n].detach().to("cpu") for n in names}
            write_safetensors(tmp / f".{file}.part", part, {"version": str(version), "format": "pt"}, fault, sums)
            os.replace(tmp / f".{file}.part", tmp / file)
            weight_map.update(dict.fromkeys(names, file))
            total += sum(t.numel() * t.element_size() for t in part.values())
            if on_shard is not None:
                on_shard(tmp, file)
        if len(shards) > 1:
            (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total, "version": str(version)},
                                                      "weight_map": weight_map}, indent=1))
        if settle is not None:
            settle()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # a retry of the same version replaces the earlier attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep is not None:
        prune_versions(root, keep)
    return final


def open_regular(path: str | Path):
    """`path` opened for reading (an unbuffered binary file), only if it is a regular file and not a link;
    ValueError naming what it is otherwise (FileNotFoundError if absent). A FIFO is opened without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: the name is a link
        what = "a symbolic link" if Path(path).is_symlink() else type(e).__name__
        raise ValueError(f"{path}: {what}; a weight sync reads only the regular files it wrote") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}.get(stat.S_IFMT(info.st_mode), "not a file")
        raise ValueError(f"{path}: {kind}; a weight sync reads only the regular files it wrote")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb", buffering=0)


def check_shard_name(name: str) -> str:
    """`name` if it is a plain safetensors file name; ValueError otherwise (a request names shards)."""
    if not isinstance(name, str) or not SHARD_NAME.match(name) or name.startswith("."):
        raise ValueError(f"shard {str(name)[:80]!r} is not a plain *.safetensors file name of the version's directory")
    return name


def shard_files(path: str | Path) -> list[str]:
    """The safetensors files of a written version, in write order (its index's, or the one unsharded file)."""
    index = Path(path) / INDEX_FILE
    if not index.exists() and not index.is_symlink():
        return [WEIGHTS_FILE]
    with open_regular(index) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_INDEX_BYTES:
            raise ValueError(f"{index}: {size} bytes, over the {MAX_INDEX_BYTES} an index may have")
        try:
            weight_map = safejson.loads(f.read(MAX_INDEX_BYTES + 1))["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not an index of safetensors shards ({type(e).__name__}: {str(e)[:120]})") \
                from None
    return [check_shard_name(file) for file in files]


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str],
                      fault: Fault | None = None, sums: dict[str, Checksum] | None = None) -> None:
    """A standard safetensors file (8-byte header size, JSON header padded to 8 bytes, the tensors'
    bytes back to back), written piece by piece from the tensors' own memory. Like safetensors'
    writer, larger dtypes first, so every tensor sits aligned to its element size in the file."""
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())  # stable: the tensors' order otherwise
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


def read_weights(path: str | Path, files: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one written version (or of its shards `files`), mapped from the files (not copied: read
    before pruning)."""
    out: dict[str, torch.Tensor] = {}
    for file in files or shard_files(path):
        with open_regular(Path(path) / check_shard_name(file)) as f:
            # Through the descriptor checked above: the name cannot be swapped for a link or a FIFO meanwhile.
            out.update(load_file(f"/proc/self/fd/{f.fileno()}"))
    return out


def read_header(f) -> tuple[list[dict], list[tuple[int, int]]]:
    """(manifest, absolute (start, end) byte range of each tensor) of an open safetensors file."""
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{f.name}: {len(head)} bytes, not a safetensors file")
    (size,) = struct.unpack("<Q", head)
    room = os.fstat(f.fileno()).st_size - 8
    if size > min(MAX_HEADER_BYTES, room):
        raise ValueError(f"{f.name}: a header of {size} bytes, over {min(MAX_HEADER_BYTES, room)} (the file's size, "
                         f"and {MAX_HEADER_BYTES}, safetensors' own limit): not a safetensors file")
    try:
        header = safejson.loads(f.read(size))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{f.name}: a safetensors header that is no JSON object ({str(e)[:120]})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{f.name}: a safetensors header that is no JSON object")
    header.pop("__metadata__", None)
    try:
        items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])  # file order
        manifest, ranges = [], []
        for name, info in items:
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{f.name}: tensor {name!r} has dtype {info['dtype']}, which the sync does not read")
            manifest.append({"name": name, "dtype": _DTYPES[info["dtype"]], "shape": info["shape"]})
            start, end = info["data_offsets"]
            ranges.append((8 + size + int(start), 8 + size + int(end)))
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{f.name}: a safetensors header entry without dtype, shape and data_offsets "
                         f"({type(e).__name__}: {str(e)[:80]})") from None
    return manifest, ranges


def receive(path: str | Path, landing, bucket_bytes: int = LANDING_BUCKET_BYTES,
            files: Sequence[str] | None = None) -> int:
    """Engine side: read every tensor of the version at `path` (or of its shards `files` only) into
    `landing`, piece by piece, each piece checksummed right after it was read (staged landings); returns
    bytes. In place (vLLM's workers): each shard's mapped tensors in one load (one call into the model)."""
    files = [check_shard_name(file) for file in files or shard_files(path)]
    if not landing.staged:
        return sum(landing.land_named(read_weights(path, [file])) for file in files)
    total, index = 0, 0
    for file in files:
        with open_regular(Path(path) / file) as f:
            manifest, ranges = read_header(f)
            where = {m["name"]: r for m, r in zip(manifest, ranges)}
            for m, (start, end) in zip(manifest, ranges):
                try:
                    need = Entry(m["name"], m["dtype"], tuple(int(d) for d in m["shape"])).nbytes
                except (TypeError, ValueError):
                    raise ValueError(f"{f.name}: tensor {str(m['name'])[:80]!r}: a shape of no whole numbers") from None
                if end - start != need:
                    raise ValueError(f"{f.name}: tensor {m['name']!r} has {end - start} bytes, its shape needs {need}")

            def read(entry: Entry, start: int, out: torch.Tensor, f=f, where=where) -> None:
                _read_exactly(f, where[entry.name][0] + start, memoryview(out.numpy()))

            for bucket in plan_buckets(manifest, bucket_bytes):
                total += landing.land_pieces(index, bucket, read)  # bucket indexes run on across shards
                index += 1
    return total


def _read_exactly(f, start: int, out: memoryview) -> None:
    done = 0
    while done < len(out):
        n = os.preadv(f.fileno(), [out[done:]], start + done)
        if n == 0:
            raise ValueError(f"{f.name}: file ends at byte {start + done}, a tensor needs {len(out) - done} more")
        done += n


class DiskTransport:
    """Trainer side: write the version shard by shard; an engine that takes shards one at a time (vLLM's
    server: start, one update per shard, finish) loads shard k while shard k + 1 is written; any other engine
    reloads the whole directory once it is complete. Engines are served in parallel."""

    name = "disk"

    def __init__(self, root: str | Path, *, keep: int = 2, fault: Fault | None = None,
                 shard_bytes: int | None = SHARD_BYTES):
        self.root = Path(root)
        self.keep = keep
        self.fault = fault
        self.shard_bytes = shard_bytes
        self.seconds: dict[str, float] = {}  # the last send's: writing, then waiting for the engines' loads
        self._pruner: threading.Thread | None = None

    def send(self, tensors: Mapping[str, torch.Tensor], engines: Sequence, version: int,
             timeout_s: float, sums: dict[str, Checksum] | None = None) -> int:
        self.close()  # the last prune is done before this version's directory appears
        shards = [e for e in engines if hasattr(e, "update_disk_shard")]
        # One thread per engine: its shards load in order, one request at a time.
        lanes = [ThreadPoolExecutor(1, thread_name_prefix="sync-disk-shard") for _ in shards]
        loads: list = []
        started = time.perf_counter()
        clock = {"written": started}

        loaded = [0.0]  # seconds of shard loads that ran while the trainer was still writing

        def load(engine, directory: str, file: str) -> None:
            began = time.perf_counter()
            engine.update_disk_shard(directory, [file], timeout_s)
            if clock["written"] == started:  # the write is not over yet
                loaded[0] += time.perf_counter() - began

        def on_shard(directory: Path, file: str) -> None:
            for done in [f for f in loads if f.done()]:
                done.result()  # an engine refused a shard: stop writing
            loads.extend(lane.submit(load, e, str(directory), file) for e, lane in zip(shards, lanes))

        def settle() -> None:
            clock["written"] = time.perf_counter()
            for f in loads:
                f.result()
            for f in [lane.submit(e.finish_disk_update, timeout_s) for e, lane in zip(shards, lanes)]:
                f.result()

        try:
            for f in [lane.submit(e.begin_disk_update, timeout_s) for e, lane in zip(shards, lanes)]:
                f.result()
            path = write_weights(tensors, self.root, version, self.fault, keep=None, sums=sums,
                                 shard_bytes=self.shard_bytes, on_shard=on_shard if shards else None, settle=settle)
        finally:
            for lane in lanes:
                lane.shutdown(wait=True)
        whole = [e for e in engines if e not in shards]
        with ThreadPoolExecutor(max(1, len(whole))) as pool:
            for f in [pool.submit(e.update_disk, str(path), timeout_s) for e in whole]:
                f.result()
        ended = time.perf_counter()
        self.seconds = {"write": clock["written"] - started, "after_write": ended - clock["written"],
                        "loaded_while_writing": loaded[0]}
        log.info("disk sync to version %d: %d shard(s) written in %.3f s (shard loads finished meanwhile: %.3f s), "
                 "engines done %.3f s later", version, len(shard_files(path)), self.seconds["write"], loaded[0],
                 self.seconds["after_write"])
        # Deleting old versions is not on the way of the new one (~10 ms per 100 MB of page cache).
        self._pruner = threading.Thread(target=prune_versions, args=(self.root, self.keep),
                                        name="sync-prune", daemon=True)
        self._pruner.start()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

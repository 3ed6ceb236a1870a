"""Every rank's collectives, from torch's flight recorder, read from outside the rank, and compared.

    serve(run, "train", rank, entries=2000)   # in the rank, before its first collective (the phase guard does it)
    record = fetch(run, hb)                    # in the node agent: that rank's recent collectives, or None
    verdict = attribute(records)               # the rank that is behind, skipped one, or entered another one

Why torch's flight recorder, and how it is read. torch 2.13's FlightRecorder records the collectives of
every process group, gloo included, once `TORCH_FR_BUFFER_SIZE` is set (read at the first collective):
the op (`gloo:all_reduce`), the group's sequence number, the input sizes, and whether the collective
completed (`retired`). DDP's gradient all-reduce, the step-boundary agreement, the experience broadcast and
the checkpoint gathers all show, with no wrapper of ours around them. torch's control-plane WorkerServer
answers `fr_trace_json` from a C++ thread of its own, so a rank blocked in a gloo wait, or holding the GIL
in C, still answers; a stopped (SIGSTOP) process answers nothing, and its process state names it instead.
The server listens on a unix socket (port -1), in a 0700 directory of this user on the node: nothing is
served on the network (torch's HTTP debug server binds "::" without authentication; it is not used).

Attribution, on the sequence numbers of one process group that every rank shares (the default group):
- `skipped`: the ranks took different collectives at one sequence number, and one rank's collective there
  is the one its peers took at the next number: it skipped the one they are in (the classic desync).
- `desync`: the ranks took different collectives at one number and no skip explains it: the odd one out
  is the rank against the majority (or every rank, named with its own collective, when there is none).
- `behind`: every rank agrees on what they did, and some have gone further: the ranks with the lowest
  last sequence number are behind (stuck before a collective their peers wait in).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlslurm.diag.heartbeat import label
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)

DEFAULT_GROUP = "default_pg"
"""torch's description of the default process group in its flight-recorder records."""
MAX_ANSWER_BYTES = 64 * 2**20
"""A flight-recorder answer longer than this is cut off (2,000 entries take ~0.6 MB)."""
KEEP_ENTRIES = 256
"""Entries per process group kept in the records the agent writes (the newest): enough to compare ranks."""

def socket_path(run: RunDir, role: str, rank: int) -> Path:
    """The node-local unix socket of one rank's recorder: short (a socket path holds 107 bytes at most) and
    the same for the rank and the agent of its node, which both know the run directory."""
    digest = hashlib.sha256(str(Path(run.path).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"rlslurm-{os.getuid()}" / f"fr-{digest}-{role}-{rank}.sock"


class Served:
    """This rank's recorder server; `close()` stops it and removes its socket (the phase guard's close)."""

    def __init__(self, server, path: Path):
        self.server, self.path = server, path

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None
            self.path.unlink(missing_ok=True)


def serve(run: RunDir, role: str, rank: int, entries: int) -> Served | None:
    """Turn on torch's flight recorder (`entries` per process) and serve it on this rank's socket. Call it
    before the first collective; a process whose recorder already started keeps its size. None when off."""
    if entries <= 0:
        return None
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))
    try:
        from torch._C._distributed_c10d import _WorkerServer
    except ImportError:  # a torch without the control plane: the agent falls back to stacks alone
        log.warning("torch has no flight-recorder server here: collectives are not recorded")
        return None
    path = socket_path(run, role, rank)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    path.unlink(missing_ok=True)  # a previous start's socket (same run, role and rank)
    served = Served(_WorkerServer(str(path), -1), path)
    # The socket listens before the server's thread enters its accept loop (cpp-httplib marks itself running
    # only there), and a shutdown() in that window (a guard closed at once, or the destructor at exit) is a
    # no-op followed by a join that waits forever in torch 2.13. A connect alone can succeed in the window
    # (the backlog accepts it), so return only once the loop has answered a request.
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX) as probe, contextlib.suppress(OSError):
            probe.settimeout(1.0)
            probe.connect(str(path))
            probe.sendall(b"GET /handler/ping HTTP/1.0\r\n\r\n")
            if probe.recv(1):
                return served
        time.sleep(0.01)
    log.warning("the flight-recorder server on %s does not answer after 30 s", path)
    return served


@dataclass(frozen=True)
class Entry:
    """One collective of one rank: its group's sequence number, the op, the input sizes, completed or not."""

    seq: int
    op: str
    sizes: list
    done: bool

    @property
    def what(self) -> str:
        return f"{self.op} #{self.seq} (sizes {self.sizes})"

    def same(self, other: "Entry") -> bool:
        return (self.op, self.sizes) == (other.op, other.sizes)


@dataclass
class RankRecord:
    """One rank's recent collectives per process group (name -> entries by sequence number)."""

    name: str
    groups: dict[str, list[Entry]] = field(default_factory=dict)

    def entries(self, group: str = DEFAULT_GROUP) -> dict[int, Entry]:
        return {e.seq: e for e in self.groups.get(group, [])}

    def last(self, group: str = DEFAULT_GROUP) -> Entry | None:
        entries = self.groups.get(group) or []
        return entries[-1] if entries else None

    def to_json(self) -> dict:
        return {"rank": self.name, "groups": {g: [[e.seq, e.op, e.sizes, e.done] for e in es]
                                              for g, es in self.groups.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "RankRecord":
        return cls(data["rank"], {g: [Entry(int(s), str(o), sz, bool(d)) for s, o, sz, d in es]
                                  for g, es in data.get("groups", {}).items()})


def parse(name: str, trace: dict) -> RankRecord:
    """A RankRecord from torch's `fr_trace_json` answer (its `entries`: collective_seq_id, profiling_name
    "gloo:all_reduce", input_sizes, retired, process_group [id, description])."""
    groups: dict[str, list[Entry]] = collections.defaultdict(list)
    for e in trace.get("entries") or []:
        if e.get("is_p2p"):
            continue  # send/recv count on their own sequence (p2p_seq_id); collectives are what ranks share
        group = (e.get("process_group") or ["", ""])[1] or str(e.get("pg_id"))
        op = str(e.get("profiling_name") or "?").split(":", 1)[-1]
        groups[group].append(Entry(int(e.get("collective_seq_id") or 0), op, e.get("input_sizes") or [],
                                   bool(e.get("retired"))))
    return RankRecord(name, {g: sorted(es, key=lambda x: x.seq)[-KEEP_ENTRIES:] for g, es in groups.items()})


def fetch(run: RunDir, hb: dict, timeout_s: float = 5.0) -> tuple[RankRecord | None, str]:
    """Ask the rank of heartbeat `hb` (on this node) for its flight recorder: (record, how it went)."""
    import httpx

    path = socket_path(run, hb.get("role"), hb.get("rank"))
    if not path.exists():
        return None, f"no recorder socket {path}"
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), timeout=timeout_s) as http:
            with http.stream("POST", "http://rank/handler/fr_trace_json") as answer:
                body = b""
                for chunk in answer.iter_bytes():
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        return None, f"answer over {MAX_ANSWER_BYTES} bytes"
                if answer.status_code != 200:
                    return None, f"HTTP {answer.status_code}: {body[:200]!r}"
        return parse(label(hb), json.loads(body)), "flight recorder"
    except (httpx.HTTPError, OSError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class Attribution:
    """Who the collective records blame: `ranks`, for `verdict` (skipped, desync, behind), at `op` #`seq`."""

    verdict: str
    ranks: list[str]
    op: str
    seq: int
    group: str
    message: str

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "ranks": self.ranks, "op": self.op, "seq": self.seq, "group": self.group,
                "message": self.message}


def attribute(records: list[RankRecord], group: str = DEFAULT_GROUP) -> Attribution | None:
    """Compare the ranks' records of `group` (see the module docstring); None when they agree and are level."""
    have = [r for r in records if r.groups.get(group)]
    if len(have) < 2:
        return None
    split = _first_divergence(have, group)
    if split is not None:
        return _diverged(have, group, split)
    last = {r.name: r.last(group) for r in have}
    lowest = min(e.seq for e in last.values())
    ahead = max(last.values(), key=lambda e: e.seq)
    if lowest == ahead.seq:
        return None
    behind = [n for n, e in last.items() if e.seq == lowest]
    waiting = [n for n, e in last.items() if e.seq == ahead.seq]
    mine = last[behind[0]]
    state = "completed" if mine.done else "not completed"
    return Attribution("behind", behind, ahead.op, ahead.seq, group,
                       f"{', '.join(behind)} {'is' if len(behind) == 1 else 'are'} behind: last collective "
                       f"{mine.what}, {state}; {', '.join(waiting)} entered {ahead.what}")


def _first_divergence(records: list[RankRecord], group: str) -> int | None:
    """The lowest sequence number that every rank has and where their collectives differ."""
    tables = [r.entries(group) for r in records]
    common = sorted(set.intersection(*(set(t) for t in tables)))
    for seq in common:
        first = tables[0][seq]
        if any(not t[seq].same(first) for t in tables[1:]):
            return seq
    return None


def _diverged(records: list[RankRecord], group: str, seq: int) -> Attribution:
    tables = {r.name: r.entries(group) for r in records}
    # A rank whose collective at `seq` is what a peer took at `seq + 1` skipped the peer's `seq`.
    skipped = {}
    for name, mine in tables.items():
        peers = [(n, t) for n, t in tables.items() if n != name and not t[seq].same(mine[seq])]
        if peers and all(seq + 1 in t and t[seq + 1].same(mine[seq]) for _, t in peers):
            skipped[name] = peers[0][1][seq]
    if len(skipped) == 1:
        (name, missed), = skipped.items()
        mine = tables[name][seq]
        took = [n for n in tables if n != name]
        return Attribution("skipped", [name], missed.op, seq, group,
                           f"{name} skipped {missed.what} that {', '.join(took)} entered: its own #{seq} is "
                           f"{mine.op} (sizes {mine.sizes}), which the others took as #{seq + 1}")
    votes = collections.Counter((t[seq].op, json.dumps(t[seq].sizes)) for t in tables.values())
    (top, count), *rest = votes.most_common()
    if rest and count > rest[0][1]:
        odd = [n for n, t in tables.items() if (t[seq].op, json.dumps(t[seq].sizes)) != top]
        e = tables[odd[0]][seq]
        return Attribution("desync", odd, e.op, seq, group,
                           f"{', '.join(odd)} entered {e.what} where {count} other rank(s) entered {top[0]} #{seq} "
                           f"(sizes {json.loads(top[1])})")
    names = list(tables)
    return Attribution("desync", names, tables[names[0]][seq].op, seq, group,
                       "the ranks entered different collectives at #" + f"{seq}: "
                       + "; ".join(f"{n} {t[seq].what}" for n, t in tables.items()))


def records_dir(run: RunDir) -> Path:
    """<run>/collectives/: the records of each hang (<stamp>/<host>.json) and each node's latest, which the
    agents of the other nodes read (latest-<host>.json). The diag bundle carries it."""
    return Path(run.path) / "collectives"


def write(records: list[RankRecord], notes: dict[str, str], path: Path) -> Path:
    """The records of one hang of one node as one JSON file: one line per rank, then how each read went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = ",\n  ".join(json.dumps(r.to_json()) for r in records)
    path.write_text(f'{{"ranks": [\n  {ranks}\n],\n "notes": {json.dumps(notes)}}}\n')
    return path


def read(path: Path) -> list[RankRecord]:
    data = json.loads(path.read_text())
    return [RankRecord.from_json(r) for r in data.get("ranks", [])]

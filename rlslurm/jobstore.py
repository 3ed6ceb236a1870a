"""The job's rendezvous store: the key-value store torch.distributed groups meet through (the trainer's default
group, MASTER_ADDR:MASTER_PORT, and the weight-broadcast group, rlslurm/sync/broadcast.py), bound to the address
the job uses and joined only by a process that proves the job's secret.

    store = rendezvous_store("10.0.0.5", 29500, rank=r, world_size=n, timeout_s=120, token=secret.read(path))
    dist.init_process_group("gloo", store=store, rank=r, world_size=n)      # or ProcessGroupGloo(store, ...)

Why not torch's TCPStore: its server (c10d TCPStore, libuv backend and the legacy one) listens on every
interface (`::`/0.0.0.0) and serves any client that connects: no credential, no hook to add one (torch 2.13's
only say in the socket is `master_listen_fd`, an already-listening socket it serves from; `use_libuv` picks the
backend; neither authenticates). A PrefixStore named after the secret is no answer (a stranger still lists,
reads and writes keys). So here the store server is our own, and torch only sees a `dist.Store` subclass
(torch calls a Python subclass's set/get/add/wait/... from C++: the c10d PythonStore trampoline):

- The server binds `host` only (the job's address: 127.0.0.1 off SLURM, the node's address on it).
- Each connection first passes a challenge-response on the job's secret: the server sends a nonce, the client
  answers HMAC-SHA256(secret, "client" | server nonce | client nonce), the server answers with its own HMAC
  (so a client knows it reached the job's store, not a squatter on the port). A wrong or late answer closes
  the connection before any key is read or written; the secret never crosses the wire.
- The whole handshake has HANDSHAKE_TIMEOUT_S, however its bytes trickle (not a timeout per read: a stranger
  sending a byte every 8 s held a connection for minutes), and at most MAX_PENDING_HANDSHAKES connections are
  in it at once. A new connection past that closes the oldest one in it, if that one is older than
  HANDSHAKE_GRACE_S (a stranger's trickle; the job's own answer in milliseconds); with none that old, the new
  one is told `RLSB` (busy) instead of the challenge. A client told so, or shut before any challenge, retries
  until its own deadline and then says the store was busy: only a refused proof is a StoreAuthError (issue
  37: 64 trickling connections made every new rank fail at once with "refused this process's proof").
- Then framed requests (an op byte and length-prefixed byte strings; no pickle, every length bounded).

Without a secret (a process started by hand, a test) `rendezvous_store` falls back to torch's TCPStore served
from a socket bound to `host` (master_listen_fd), and only on a loopback address: an address other hosts reach
needs the secret. `job_token()` finds the job's secret: RLSLURM_SECRET_FILE, else <RLSLURM_RUN_DIR>/secret.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

import torch.distributed as dist

NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds a connection has from accept to a proved secret, all reads together; then it is closed."""
MAX_FRAME_BYTES = 64 << 20
MAX_ARGS = 1 << 16
MAX_PENDING_HANDSHAKES = 64
"""Connections at once that have not yet proved the secret (each a thread waiting on 64 bytes)."""
HANDSHAKE_GRACE_S = 0.5
"""A connection in its handshake this young is not closed to make room for a new one."""
CONNECT_RETRY_S = 0.05
BUSY = b"RLSB"
"""What the store sends instead of its challenge when its handshake slots are all taken: retry."""

OPS = ("set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys", "multi_get", "multi_set",
       "append", "list_keys")
OK, ERROR, TIMEOUT = 0, 1, 2


class StoreAuthError(ConnectionError):
    """The peer did not prove the job's secret (or the store refused ours)."""


def job_token(token: str | None = None) -> str | None:
    """The job's secret for the rendezvous: `token`, else the file RLSLURM_SECRET_FILE names, else the run
    directory's (RLSLURM_RUN_DIR/secret) when it exists; None when the process has none."""
    from rlslurm import secret
    from rlslurm.rundir import ENV_VAR

    if token:
        return token
    if os.environ.get(secret.ENV_VAR):
        return secret.read(os.environ[secret.ENV_VAR])
    run = os.environ.get(ENV_VAR)
    if run and (Path(run) / secret.FILE_NAME).exists():
        return secret.read(Path(run) / secret.FILE_NAME)
    return None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` only (port 0: any free one), never every interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


# -- framing ---------------------------------------------------------------------------------------------------

def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with a deadline (time.monotonic), all of them by then (socket.timeout past it)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{len(buf)} of {n} bytes by the deadline")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("store connection closed")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, code: int, args: list[bytes]) -> None:
    body = b"".join(struct.pack("!I", len(a)) + a for a in args)
    sock.sendall(struct.pack("!IBI", 5 + len(body), code, len(args)) + body)


def _recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    (size,) = struct.unpack("!I", _recv_exact(sock, 4))
    if not 5 <= size <= MAX_FRAME_BYTES:
        raise ConnectionError(f"store frame of {size} bytes is outside [5, {MAX_FRAME_BYTES}]")
    frame = _recv_exact(sock, size)
    code, count = struct.unpack("!BI", frame[:5])
    if count > MAX_ARGS:
        raise ConnectionError(f"store frame of {count} arguments is over {MAX_ARGS}")
    args, at = [], 5
    for _ in range(count):
        if at + 4 > size:
            raise ConnectionError("store frame truncated")
        (n,) = struct.unpack("!I", frame[at:at + 4])
        at += 4
        if at + n > size:
            raise ConnectionError("store frame truncated")
        args.append(frame[at:at + n])
        at += n
    return code, args


def _mac(token: str, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token.encode(), b"rlslurm-store/" + role + b"/" + server_nonce + client_nonce,
                    hashlib.sha256).digest()


# -- server ------------------------------------------------------------------------------------------------------

class StoreServer:
    """The job's key-value store: a thread per authenticated connection, bound to one address."""

    def __init__(self, host: str, port: int, token: str):
        self.token = token
        self.sock = bound_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.pending: dict[socket.socket, float] = {}  # connections in their handshake -> accepted at (monotonic)
        self.pending_lock = threading.Lock()
        self.refused = 0  # connections that failed the challenge: tests and logs read it
        self.evicted = 0  # connections closed in their handshake to make room for a new one
        self.busy = 0  # connections told BUSY
        self._closed = False
        threading.Thread(target=self._accept, name=f"jobstore-{self.port}", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._admit(conn):
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> bool:
        """Make room among the connections in their handshake: close the oldest past the grace, or tell the
        new one BUSY (False) when all are younger."""
        now = time.monotonic()
        with self.pending_lock:
            if len(self.pending) >= MAX_PENDING_HANDSHAKES:
                oldest, since = next(iter(self.pending.items()))
                if now - since < HANDSHAKE_GRACE_S:
                    self.busy += 1
                    try:
                        conn.settimeout(1.0)
                        conn.sendall(BUSY)
                    except OSError:
                        pass
                    conn.close()
                    return False
                del self.pending[oldest]
                self.evicted += 1
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread's read ends; the thread closes it
                except OSError:
                    pass
            self.pending[conn] = now
        return True

    def _handshake(self, conn: socket.socket) -> bool:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            server_nonce = secrets.token_bytes(NONCE_BYTES)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.sendall(b"RLSS" + server_nonce)
            answer = _recv_exact(conn, NONCE_BYTES + 32, deadline)
            client_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
            if not hmac.compare_digest(mac, _mac(self.token, b"client", server_nonce, client_nonce)):
                self.refused += 1
                return False
            conn.sendall(_mac(self.token, b"server", server_nonce, client_nonce))
        except (OSError, ConnectionError):
            self.refused += 1
            return False
        finally:
            with self.pending_lock:
                self.pending.pop(conn, None)
        conn.settimeout(None)
        return True

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if not self._handshake(conn):
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while True:
                    code, args = _recv_frame(conn)
                    try:
                        status, out = self._do(code, args)
                    except (ValueError, IndexError, KeyError) as e:
                        status, out = ERROR, [f"{type(e).__name__}: {e}".encode()]
                    _send_frame(conn, status, out)
            except (OSError, ConnectionError):
                return

    def _do(self, code: int, args: list[bytes]) -> tuple[int, list[bytes]]:
        op = OPS[code]
        keys = [a.decode(errors="surrogateescape") for a in args]  # only the key arguments are read as keys
        with self.cond:
            if op == "set":
                self.data[keys[0]] = args[1]
            elif op == "get":
                return OK, [self.data[keys[0]]]
            elif op == "add":
                value = int(self.data.get(keys[0], b"0")) + int(args[1])
                self.data[keys[0]] = str(value).encode()
                return OK, [self.data[keys[0]]]
            elif op == "compare_set":
                current = self.data.get(keys[0])
                if (current is None and not args[1]) or current == args[1]:
                    self.data[keys[0]] = args[2]
                    current = args[2]
                return OK, [args[1] if current is None else current]
            elif op == "wait":  # args: timeout in ms, then the keys
                deadline = time.monotonic() + int(args[0]) / 1000
                ok = self.cond.wait_for(lambda: all(k in self.data for k in keys[1:]),
                                        max(0.0, deadline - time.monotonic()))
                return (OK if ok else TIMEOUT), []
            elif op == "check":
                return OK, [b"1" if all(k in self.data for k in keys) else b"0"]
            elif op == "delete_key":
                return OK, [b"1" if self.data.pop(keys[0], None) is not None else b"0"]
            elif op == "num_keys":
                return OK, [str(len(self.data)).encode()]
            elif op == "multi_get":
                return OK, [self.data[k] for k in keys]
            elif op == "multi_set":
                half = len(args) // 2
                self.data.update(zip(keys[:half], args[half:]))
            elif op == "append":
                self.data[keys[0]] = self.data.get(keys[0], b"") + args[1]
            elif op == "list_keys":
                return OK, [k.encode() for k in self.data]
            self.cond.notify_all()
        return OK, []


# -- client ------------------------------------------------------------------------------------------------------

def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class JobStore(dist.Store):
    """A torch.distributed Store whose every call goes over one authenticated connection to a StoreServer.
    `get` and `wait` block until their keys exist, up to the store's timeout (RuntimeError past it, as torch's
    stores do, so a missing peer fails the rendezvous instead of hanging it)."""

    def __init__(self, host: str, port: int, token: str, timeout: datetime.timedelta,
                 server: StoreServer | None = None):
        super().__init__()
        self.host, self.port, self.token = host, port, token
        self._timeout = timeout
        self.server = server  # rank 0's: kept alive as long as the store
        self._lock = threading.Lock()
        self._sock = self._connect(timeout.total_seconds())

    def _connect(self, timeout_s: float) -> socket.socket:
        """An authenticated connection, within `timeout_s`: retried while the store is not up yet, or busy with
        other connections' handshakes (told BUSY, or shut before its challenge); StoreAuthError only for a
        refused proof or a store that does not prove the secret."""
        deadline = time.monotonic() + timeout_s
        busy, last = 0, ""
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
            except OSError as e:  # the store's host may not be up yet
                last = f"{type(e).__name__}: {e}"
            else:
                try:
                    hello = _recv_exact(sock, 4 + NONCE_BYTES, min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S))
                except (ConnectionError, OSError) as e:
                    sock.close()
                    busy, last = busy + 1, f"shut before its challenge ({type(e).__name__}: {e})"
                else:
                    if hello[:4] != BUSY:
                        return self._prove(sock, hello)
                    sock.close()
                    busy, last = busy + 1, "busy (all its handshake slots taken)"
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job's store {self.host}:{self.port} did not admit this process within "
                                   f"{timeout_s:.0f} s: {busy} attempts were turned away before the challenge "
                                   f"(connections that have not proved the secret may hold its handshake slots); "
                                   f"last: {last}")
            time.sleep(min(CONNECT_RETRY_S * 2 ** min(busy, 5), max(0.0, deadline - time.monotonic())))

    def _prove(self, sock: socket.socket, hello: bytes) -> socket.socket:
        """The challenge-response on `sock`, whose server sent `hello`."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            if hello[:4] != b"RLSS":
                raise StoreAuthError(f"{self.host}:{self.port} is not the job's store")
            server_nonce, client_nonce = hello[4:], secrets.token_bytes(NONCE_BYTES)
            sock.sendall(client_nonce + _mac(self.token, b"client", server_nonce, client_nonce))
            proof = _recv_exact(sock, 32, deadline)
        except StoreAuthError:
            sock.close()
            raise
        except (ConnectionError, OSError) as e:
            sock.close()
            raise StoreAuthError(f"the store at {self.host}:{self.port} refused this process's proof of the job's "
                                 f"secret (another job's store on this port, or another secret): {e}") from None
        if not hmac.compare_digest(proof, _mac(self.token, b"server", server_nonce, client_nonce)):
            sock.close()
            raise StoreAuthError(f"{self.host}:{self.port} did not prove the job's secret: not the job's store")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _call(self, op: str, *args: bytes) -> list[bytes]:
        with self._lock:
            _send_frame(self._sock, OPS.index(op), list(args))
            status, out = _recv_frame(self._sock)
        if status == TIMEOUT:
            raise RuntimeError(f"Timeout waiting for keys in the job's store {self.host}:{self.port} "
                               f"({self.timeout.total_seconds():.0f} s)")
        if status != OK:
            raise RuntimeError(f"the job's store: {out[0].decode(errors='replace')}")
        return out

    # torch's Store API ------------------------------------------------------------------------------------
    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def _wait_ms(self, timeout=None) -> bytes:
        t = timeout if timeout is not None else self._timeout
        return str(int(t.total_seconds() * 1000)).encode()

    def set(self, key, value) -> None:
        self._call("set", _bytes(key), _bytes(value))

    def get(self, key) -> bytes:
        self.wait([key])
        return self._call("get", _bytes(key))[0]

    def add(self, key, amount) -> int:
        return int(self._call("add", _bytes(key), str(int(amount)).encode())[0])

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call("compare_set", _bytes(key), _bytes(expected), _bytes(desired))[0]

    def wait(self, keys, timeout=None) -> None:
        self._call("wait", self._wait_ms(timeout), *[_bytes(k) for k in keys])

    def check(self, keys) -> bool:
        return self._call("check", *[_bytes(k) for k in keys])[0] == b"1"

    def delete_key(self, key) -> bool:
        return self._call("delete_key", _bytes(key))[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call("num_keys")[0])

    def multi_get(self, keys) -> list[bytes]:
        self.wait(keys)
        return self._call("multi_get", *[_bytes(k) for k in keys])

    def multi_set(self, keys, values) -> None:
        self._call("multi_set", *[_bytes(k) for k in keys], *[_bytes(v) for v in values])

    def append(self, key, value) -> None:
        self._call("append", _bytes(key), _bytes(value))

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call("list_keys")]

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "JobStore":
        return JobStore(self.host, self.port, self.token, self._timeout)

    def close(self) -> None:
        self._sock.close()
        if self.server is not None:
            self.server.close()

    def __del__(self):
        # A dropped group (a broadcast group rebuilt after a failure) takes its listener and connections with it,
        # as torch's TCPStore does in its destructor.
        try:
            self.close()
        except Exception:
            pass


def rendezvous_store(host: str, port: int, *, rank: int, world_size: int, timeout_s: float,
                     token: str | None) -> dist.Store:
    """The store a group of `world_size` ranks meets through, hosted by rank 0 on `host`:`port` (bound to that
    address only): a JobStore when the job's secret is known, else (loopback only) torch's TCPStore."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if token:
        server = StoreServer(host, port, token) if rank == 0 else None
        return JobStore(host, port, token, timeout, server=server)
    if not is_loopback(host):
        from rlslurm.errors import RlslurmError

        raise RlslurmError(f"the rendezvous store on {host}:{port} is reachable from other hosts, and this process "
                           "has no job secret to admit only the job's ranks: start it through rlslurm (which sets "
                           "RLSLURM_RUN_DIR), or set RLSLURM_SECRET_FILE to the run's secret file")
    # The descriptor is handed over (detach): torch's server listens on it from then on and closes it.
    listen_fd = bound_socket(host, port).detach() if rank == 0 else None
    return dist.TCPStore(host, port, world_size, rank == 0, timeout, wait_for_workers=False,
                         master_listen_fd=listen_fd)

"""A stranger on the machine, at the connection level (issue 37), against any server of a job on loopback: the
transformers engine and the reward service (test_conn_guard.py), vLLM's API server (tests/vllm/test_vllm_bounds.py).

    peak = big_bodies(url, pid, ["/health", "/v1/completions"], count=20, mib=60)   # RSS growth of pid, MiB
    with Trickle(url, 64) as strangers:       # 64 connections, one byte of a head every interval_s
        ...                                   # the job's own calls meanwhile; strangers.closed() counts
                                              # the ones the server shut

Everything is bounded in count and time, and goes to 127.0.0.1 only."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import psutil

CHUNK = 1 << 20


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"attack traffic goes to loopback only, not {url}")
    return parts.hostname, parts.port


def _send_body(url: str, path: str, mib: int, deadline: float, sent: list[int]) -> None:
    """One POST without the secret, its `mib` MiB body chunked (no length announced: a server must count it),
    sent until done, refused or the deadline."""
    host, port = _address(url)
    total = 0
    try:
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n".encode())
            chunk = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
            while total < mib << 20 and time.monotonic() < deadline:
                sock.sendall(chunk)
                total += CHUNK
            sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server shut the connection: what a refused stranger should see
    sent.append(total)


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


class PeakRSS:
    """The RSS of process `pid` sampled every 20 ms while the block runs: `base_mib`, `peak_mib`, `growth_mib`."""

    def __init__(self, pid: int):
        self.pid, self.stop = pid, threading.Event()

    def __enter__(self) -> "PeakRSS":
        self.base_mib = self.peak_mib = rss_mib(self.pid)
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak_mib = max(self.peak_mib, rss_mib(self.pid))
            self.stop.wait(0.02)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.growth_mib = self.peak_mib - self.base_mib


def big_bodies(url: str, pid: int, paths: list[str], *, count: int = 20, mib: int = 60,
               time_s: float = 20.0) -> dict:
    """`count` callers at once, spread over `paths`, each sending a `mib` MiB body without the secret; the RSS of
    process `pid` sampled every 20 ms meanwhile. {"base_mib", "peak_mib", "growth_mib", "sent_mib", "seconds"}."""
    memory = PeakRSS(pid).__enter__()
    sent: list[int] = []
    start = time.monotonic()
    deadline = start + time_s
    senders = [threading.Thread(target=_send_body, args=(url, paths[i % len(paths)], mib, deadline, sent),
                                daemon=True) for i in range(count)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(time_s + 10)
    seconds = time.monotonic() - start
    time.sleep(0.5)  # what the server still holds just after
    memory.__exit__(None, None, None)
    return {"base_mib": memory.base_mib, "peak_mib": memory.peak_mib, "growth_mib": memory.growth_mib,
            "sent_mib": sum(sent) / 2**20, "seconds": seconds}


class Trickle:
    """`count` connections without the secret, each sending one byte of a request's head every `interval_s`
    (a head that never ends), for at most `time_s`; `closed()` counts those the server has shut."""

    def __init__(self, url: str, count: int, *, interval_s: float = 1.0, time_s: float = 60.0):
        self.address = _address(url)
        self.count, self.interval_s, self.time_s = count, interval_s, time_s
        self.socks: list[socket.socket] = []
        self.shut: set[int] = set()
        self.stop = threading.Event()
        self.opened_at = 0.0

    def __enter__(self) -> "Trickle":
        for _ in range(self.count):
            sock = socket.create_connection(self.address, timeout=5)
            sock.setblocking(False)
            self.socks.append(sock)
        self.opened_at = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100_000
        at = 0
        end = time.monotonic() + self.time_s
        while not self.stop.wait(self.interval_s) and time.monotonic() < end:
            for i, sock in enumerate(self.socks):
                if i in self.shut:
                    continue
                try:
                    if sock.recv(1024) == b"":
                        self.shut.add(i)
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    self.shut.add(i)
                    continue
                try:
                    sock.send(head[at % len(head):at % len(head) + 1])
                except OSError:
                    self.shut.add(i)
            at += 1

    def closed(self) -> int:
        return len(self.shut)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.socks:
            sock.close()


def endless_head(url: str, pid: int, *, mib: int = 32, time_s: float = 10.0) -> dict:
    """One connection sending a request head that never ends, 64 KiB header lines up to `mib` MiB (llhttp, the
    parser of uvicorn's httptools protocol, keeps them all); {"sent_mib", "growth_mib", "shut"}: whether the
    server shut the connection before it was all sent."""
    host, port = _address(url)
    base, sent, shut = rss_mib(pid), 0, False
    line = b"X-Pad: " + b"a" * 65536 + b"\r\n"
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=5) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            while sent < mib << 20 and time.monotonic() - start < time_s:
                sock.sendall(line)
                sent += len(line)
        except OSError:
            shut = True
        growth = rss_mib(pid) - base
    return {"sent_mib": sent / 2**20, "growth_mib": growth, "shut": shut}

"""Connections that have not proved the job's secret: uvicorn's HTTP protocol with a deadline and a size bound on
a request's head, one request per such connection, and a bound on how many one server holds at once.

    uvicorn.Config(app, host=host, port=port, http=connguard.protocol(token))   # the engine, the reward service
    connguard.install(token)    # vLLM's API server: uvicorn's "auto" protocol becomes this one (rollout/vllm_api.py)

rlslurm/wire.py's Protect is an ASGI middleware: it runs once a request's head has arrived, and it answers a
caller without the secret before reading a byte of the body. What happens before that, it cannot see: a
stranger that opens connections and trickles their heads a byte at a time holds them for as long as it likes
(uvicorn has no deadline on a head) and grows each by whatever it sends. So, per connection:

- it is *proven* once a request on it carries the job's secret (Authorization: Bearer, compared in constant
  time); from then on nothing here applies to it (it is the job's);
- until then its request's head must be complete within `head_timeout_s` of the connection's start and within
  `max_head_bytes`: past either it is closed, whatever it sent meanwhile;
- an unproven connection is answered once (keep-alive off: `connection: close`), then closed gracefully: our
  side is shut for writing so the caller reads the whole answer, what it still sends (a refused body) is read
  and dropped, and after `linger_s` the connection is closed (a caller refused mid-body gets its 401 / 413
  rather than a reset, and holds nothing);
- at most `max_unproven` unproven connections per server: a new one past that closes the oldest one still
  sending its head, if that one is older than `grace_s` (a stranger's trickle is old; a burst of the job's own
  connections, whose heads arrive in milliseconds, is not); with none to close, past `max_young` the new
  connection is closed itself. So a stranger holding connections delays a job client by nothing: its new
  connection takes the place of the stranger's oldest;
- no WebSocket upgrade (no route of a job takes one; the HTTP request is answered as HTTP by the gate).

Measured (tests/integration/test_conn_guard.py, docs/trust.md): 64 trickling stranger connections, and the
job's clients are answered at once; 20 callers sending 60 MiB bodies without the secret, and the server's RSS
stays flat.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from rlslurm.secret import matches

log = logging.getLogger("rlslurm.connguard")


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The bounds on one server's connections before they prove the job's secret."""

    token: str | None
    """The job's secret; None: no connection is ever proven (every one is held to the bounds)."""
    head_timeout_s: float = 10.0
    """Seconds from a connection's start until its request's head must be complete."""
    max_head_bytes: int = 16 << 10
    """Bytes a request's head may take (h11's own default; the job's heads are a few hundred)."""
    max_unproven: int = 64
    """Unproven connections one server holds before a new one closes the oldest."""
    grace_s: float = 1.0
    """An unproven connection younger than this is not closed to make room (a burst of the job's own)."""
    max_young: int = 4096
    """Unproven connections, all younger than grace_s, past which a new one is closed at once: above the largest
    burst of the job's own (the reward client opens up to reward.concurrency <= 4096 at a step's start), and
    each holds at most max_head_bytes."""
    linger_s: float = 2.0
    """Seconds an answered unproven connection's further input is read and dropped before it is closed."""


class _Lingering:
    """The transport uvicorn's protocol sees: its close() of an unproven connection is a lingering close."""

    def __init__(self, transport: asyncio.Transport, owner):
        self._real, self._owner = transport, owner

    def __getattr__(self, name):
        return getattr(self._real, name)

    def close(self) -> None:
        owner, real = self._owner, self._real
        if owner.proven or owner.closing_now or owner.lingering or real.is_closing() or not real.can_write_eof():
            if not owner.lingering:
                real.close()
            return
        owner.lingering = True
        try:
            real.write_eof()  # FIN after the answer: the caller reads it whole
            real.resume_reading()  # uvicorn may have paused it; what comes now is read and dropped
        except (OSError, RuntimeError):
            real.close()
            return
        owner.loop.call_later(owner.policy.linger_s, real.close)


def _closing(send):
    """A cycle's `send` whose answer says `connection: close` (uvicorn's h11 protocol says so only when the
    request did), so the caller opens a new connection for its next request instead of finding this one shut."""
    async def closing(message):
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"connection" for name, _ in headers):
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing


def guarded(base: type, policy: Policy) -> type:
    """`base` (uvicorn's H11Protocol or HttpToolsProtocol) with the bounds of `policy`; one class per server."""
    unproven: dict = {}  # the server's unproven connections, oldest first -> their start (loop time)

    class Guarded(base):
        def connection_made(self, transport) -> None:
            self.policy, self.proven, self.lingering, self.closing_now = policy, False, False, False
            self.head_bytes, self.answered = 0, False
            super().connection_made(_Lingering(transport, self))
            now = self.loop.time()
            self.head_timer = self.loop.call_later(policy.head_timeout_s, self._drop, "head past its deadline")
            unproven[self] = now
            if len(unproven) > policy.max_unproven:
                oldest = next((c for c, t in unproven.items() if not c.answered and now - t >= policy.grace_s), None)
                if oldest is not None:
                    oldest._drop(f"oldest of {len(unproven)} unproven connections")
                elif len(unproven) > policy.max_young:
                    self._drop(f"{len(unproven)} unproven connections, all younger than {policy.grace_s} s")

        def data_received(self, data: bytes) -> None:
            if self.lingering:
                return  # the rest of a refused request: dropped
            if self.proven:
                return super().data_received(data)
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before and not self.answered:
                self._head_arrived()
            elif not self.answered:
                self.head_bytes += len(data)
                if self.head_bytes > policy.max_head_bytes:
                    self._drop(f"head over {policy.max_head_bytes} bytes")

        def _head_arrived(self) -> None:
            self.head_timer.cancel()
            self.answered = True
            presented = next((v for k, v in self.cycle.scope["headers"] if k == b"authorization"), None)
            if policy.token and matches(presented.decode("latin-1") if presented else None, policy.token):
                self.proven = True
                unproven.pop(self, None)
            else:  # one answer, then the lingering close
                self.cycle.keep_alive = False
                self.cycle.send = _closing(self.cycle.send)

        def _drop(self, why: str) -> None:
            log.debug("closing an unproven connection from %s: %s", self.client, why)
            unproven.pop(self, None)
            self.head_timer.cancel()
            self.transport._real.close()

        def connection_lost(self, exc) -> None:
            unproven.pop(self, None)
            self.head_timer.cancel()
            super().connection_lost(exc)

        def shutdown(self) -> None:
            self.closing_now = True  # the server is stopping: no lingering
            super().shutdown()

        def _should_upgrade_to_ws(self) -> bool:
            return False

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    Guarded.unproven = unproven
    return Guarded


def protocol(token: str | None, **bounds) -> type:
    """uvicorn's HTTP protocol for this interpreter ("auto": httptools when installed, else h11), guarded."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return guarded(AutoHTTPProtocol, Policy(token=token, **bounds))


GUARDED: type | None = None
"""The guarded protocol `install` put in uvicorn's registry (uvicorn imports it by name)."""


def install(token: str | None, **bounds) -> None:
    """Make uvicorn's "auto" HTTP protocol the guarded one in this process: for a server rlslurm does not
    configure itself (vLLM's API server builds its uvicorn.Config; rollout/vllm_api.py calls this first)."""
    global GUARDED
    from uvicorn import config

    GUARDED = protocol(token, **bounds)
    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:GUARDED"

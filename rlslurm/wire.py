"""The trust boundary in front of every HTTP server of a job (rollout engine, reward service): the job's
secret and a bounded body, checked before any route runs; malformed bodies are a 400.

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    protect(app, token, open_paths={"/health"}, data_paths={"/v1/completions"}, open_data=False,
            max_body_bytes=lambda path: 16 << 20)

Default deny: every path needs `Authorization: Bearer <the job's secret>` (rlslurm/secret.py) but those
named open (`/health`, which tells nothing secret) and, only when the job's config opens its data plane,
the data paths. A request without the token, or with a wrong one, is 401 before its body is read. An open
path that is not a data path reads no body at all (one announced is a 413: a stranger's 60 MiB to /health
was buffered whole). A body longer than its path's limit is 413 without being buffered past the limit
(Content-Length is checked first, a chunked body is counted as it arrives), and the whole body must arrive
within BODY_TIMEOUT_S (408), however it trickles. Callers without the secret on an open data plane are
served MAX_OPEN_REQUESTS at a time (503 with Retry-After past that), so what strangers hold is bounded by
that many bodies. Errors are OpenAI-shaped ({"error": {"message", "type"}}), so an `openai` client shows
the message. What happens before a request's head is complete (deadlines, how many connections a stranger
holds) is rlslurm/connguard.py's, the server's HTTP protocol.

Why an ASGI middleware, not a FastAPI dependency per route: a route added later is protected without
anyone remembering to; and the limit must act before FastAPI parses a body into memory.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable, Iterable

from rlslurm.secret import matches

BODY_TIMEOUT_S = 30.0
"""Seconds a request's whole body may take to arrive, from its head (a 64 MiB update manifest at 2 MiB/s)."""
MAX_OPEN_REQUESTS = 16
"""Requests at once from callers without the secret on an open data plane (each holds at most its body limit)."""


def error_body(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind}}


async def _reply(send, status: int, message: str, kind: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(message, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive, limit: int) -> bytes | int | None:
    """The whole body; its size so far once past `limit` (the rest unread); None when the caller left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return size
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _no_body(receive):
    """`receive` of a route that reads no body: an empty one, then the server's own (a disconnect)."""
    given = False

    async def empty():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await receive()

    return empty


class Protect:
    """ASGI middleware: authenticate, then bound and buffer the body, then call the app."""

    def __init__(self, app, *, token: str, open_paths: Iterable[str], data_paths: Iterable[str],
                 open_data: bool, max_body_bytes: Callable[[str], int]):
        self.app, self.token = app, token
        self.data_paths = set(data_paths)
        self.open_paths = set(open_paths) | (self.data_paths if open_data else set())
        self.max_body_bytes = max_body_bytes
        self.open_slots = asyncio.Semaphore(MAX_OPEN_REQUESTS)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        presented = dict(scope["headers"]).get(b"authorization")
        proven = matches(presented.decode("latin-1") if presented else None, self.token)
        if path not in self.open_paths and not proven:
            return await _reply(send, 401, f"{path} needs the job's secret: Authorization: Bearer <token "
                                "in the run directory's secret file>", "unauthorized",
                                [(b"www-authenticate", b"Bearer")])
        refused = self.check_route(path)
        if refused is not None:
            return await _reply(send, 403, refused, "route_not_served")
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if path in self.open_paths and path not in self.data_paths:
            if (length not in (None, b"0")) or b"transfer-encoding" in headers:
                return await _reply(send, 413, f"{path} reads no request body", "request_too_large")
            return await self.app(scope, _no_body(receive), send)
        limit = self.max_body_bytes(path)
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _reply(send, 413, f"request body of {length.decode('latin-1')[:20]} bytes is over "
                                f"this route's limit of {limit} bytes", "request_too_large")
        if proven:
            return await self._bounded(scope, receive, send, limit)
        if self.open_slots.locked():
            return await _reply(send, 503, f"{MAX_OPEN_REQUESTS} requests without the job's secret are in "
                                "flight; retry shortly", "engine_unavailable", [(b"retry-after", b"1")])
        async with self.open_slots:
            return await self._bounded(scope, receive, send, limit)

    async def _bounded(self, scope, receive, send, limit: int):
        """Buffer the body (within `limit` and BODY_TIMEOUT_S), check it, then call the app with it."""
        path = scope["path"]
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                body = await _read_body(receive, limit)
        except TimeoutError:
            return await _reply(send, 408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                                "request_timeout")
        if body is None:
            return None  # the caller left
        if isinstance(body, int):
            return await _reply(send, 413, f"request body over this route's limit of {limit} bytes",
                                "request_too_large")
        problem = self.check_body(path, body)
        if problem is not None:
            return await _reply(send, 400, problem, "invalid_request_error")
        replayed = False

        async def replay():
            # The buffered body once, then the server's own receive: the app still sees a disconnect.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def check_route(self, path: str) -> str | None:
        """A subclass's refusal of a path, once its caller is authenticated (vLLM's gate: a route it does not
        know, rollout/vllm_serve.py): a message = 403."""
        return None

    def check_body(self, path: str, body: bytes) -> str | None:
        """A subclass's bounds on a body (e.g. vLLM's server, rollout/vllm_serve.py): a message = 400."""
        return None


def protect(app, token: str, *, open_paths: Iterable[str] = ("/health",), data_paths: Iterable[str] = (),
            open_data: bool = False, max_body_bytes: Callable[[str], int]) -> None:
    """Put `Protect` in front of a FastAPI app and turn its body validation errors into 400s."""
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def invalid(_request, exc: RequestValidationError):
        # Where and what, never the offending value itself (it may be large, or someone's secret).
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:8])
        return JSONResponse(error_body(f"invalid request: {problems}", "invalid_request_error"), status_code=400)

    async def unreadable(request, exc: StarletteHTTPException):
        # FastAPI turns any error of json.loads but JSONDecodeError into a bare 400 "error parsing the body":
        # say which bound it was (100,000 `[` is a RecursionError, a 100,000-digit integer a ValueError).
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, RecursionError | ValueError):
            what = ("is nested deeper than the server's JSON parser goes" if isinstance(cause, RecursionError)
                    else f"could not be read as JSON: {str(cause)[:160]}")
            return JSONResponse(error_body(f"the request body {what}", "invalid_request_error"), status_code=400)
        return await http_exception_handler(request, exc)

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, unreadable)
    app.add_middleware(Protect, token=token, open_paths=open_paths, data_paths=data_paths, open_data=open_data,
                       max_body_bytes=max_body_bytes)

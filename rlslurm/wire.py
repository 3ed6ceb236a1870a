"""The trust boundary in front of every HTTP server of a job (rollout engine, reward service): the job's
secret and a bounded body, checked before any route runs; malformed bodies are a 400.

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    protect(app, token, open_paths={"/health"}, data_paths={"/v1/completions"}, open_data=False,
            max_body_bytes=lambda path: 16 << 20)

Default deny: every path needs `Authorization: Bearer <the job's secret>` (rlslurm/secret.py) but those
named open (`/health`, which tells nothing secret) and, only when the job's config opens its data plane,
the data paths. A request without the token, or with a wrong one, is 401 before its body is read. A body
longer than its path's limit is 413 without being buffered past the limit (Content-Length is checked
first, a chunked body is counted as it arrives). Errors are OpenAI-shaped ({"error": {"message",
"type"}}), so an `openai` client shows the message.

Why an ASGI middleware, not a FastAPI dependency per route: a route added later is protected without
anyone remembering to; and the limit must act before FastAPI parses a body into memory.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

from rlslurm.secret import matches


def error_body(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind}}


async def _reply(send, status: int, message: str, kind: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(message, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class Protect:
    """ASGI middleware: authenticate, then bound and buffer the body, then call the app."""

    def __init__(self, app, *, token: str, open_paths: Iterable[str], data_paths: Iterable[str],
                 open_data: bool, max_body_bytes: Callable[[str], int]):
        self.app, self.token = app, token
        self.open_paths = set(open_paths) | (set(data_paths) if open_data else set())
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path not in self.open_paths:
            presented = dict(scope["headers"]).get(b"authorization")
            if not matches(presented.decode("latin-1") if presented else None, self.token):
                return await _reply(send, 401, f"{path} needs the job's secret: Authorization: Bearer <token "
                                    "in the run directory's secret file>", "unauthorized",
                                    [(b"www-authenticate", b"Bearer")])
        refused = self.check_route(path)
        if refused is not None:
            return await _reply(send, 403, refused, "route_not_served")
        limit = self.max_body_bytes(path)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _reply(send, 413, f"request body of {length.decode('latin-1')[:20]} bytes is over "
                                f"this route's limit of {limit} bytes", "request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _reply(send, 413, f"request body over this route's limit of {limit} bytes",
                                    "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        problem = self.check_body(path, b"".join(chunks))
        if problem is not None:
            return await _reply(send, 400, problem, "invalid_request_error")
        replayed = False

        async def replay():
            # The buffered body once, then the server's own receive: the app still sees a disconnect.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
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
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    async def invalid(_request, exc: RequestValidationError):
        # Where and what, never the offending value itself (it may be large, or someone's secret).
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:8])
        return JSONResponse(error_body(f"invalid request: {problems}", "invalid_request_error"), status_code=400)

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_middleware(Protect, token=token, open_paths=open_paths, data_paths=data_paths, open_data=open_data,
                       max_body_bytes=max_body_bytes)

"""The controller's client of rlslurm's rollout engine server, and the process of one such server.

    engine = spawn_engine(model_dir, port=p, log_path=run.logs / "engine-0.log", secret_file=run.secret)
    # rlslurm/rollout/launcher.py (hf or vllm); or EngineClient(url, token=secret.read(run.secret))
    out = engine.client.completions(["2 + 3 ="], n=4, max_tokens=8, temperature=1.0)
    out["policy_version"], out["choices"][0]["token_ids"]

Every call carries the job's secret (Authorization: Bearer) and has a timeout; an engine that does not
answer raises `EngineRequestError` naming the engine's URL, the call and what came back. Admin calls
(drain, update, verify, resume, ...) are used by the weight-sync protocol in rlslurm/sync/protocol.py.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import psutil

from rlslurm import secret
from rlslurm.errors import RlslurmError

log = logging.getLogger(__name__)


class EngineRequestError(RlslurmError):
    """A rollout engine server refused a call, failed it, or did not answer in time."""

    exit_code = 6

    def __init__(self, message: str, status: int | None = None, retry_after_s: float | None = None, *,
                 url: str | None = None, call: str | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.url = url  # the engine: the controller's `engine_failed` event names its node, pid and log
        self.call = call  # what was asked, e.g. "POST /v1/completions" ("start": it never became healthy)


class EngineClient:
    """One engine server at `url` (http://host:port); `token` is the job's secret (rlslurm/secret.py)."""

    def __init__(self, url: str, timeout_s: float = 120.0, *, token: str | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.token = token  # also an OpenAI client's api_key
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=secret.bearer(token))

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    def _call(self, method: str, path: str, timeout_s: float | None = None, **kwargs) -> dict:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        call = f"{method} {path}"
        try:
            r = self._http.request(method, path, timeout=timeout, **kwargs)
        except httpx.TimeoutException:
            raise EngineRequestError(f"engine {self.url}: {call} got no answer within {timeout:.1f} s",
                                     url=self.url, call=call) from None
        except httpx.HTTPError as e:
            raise EngineRequestError(f"engine {self.url}: {call} failed: {type(e).__name__}: {e}",
                                     url=self.url, call=call) from None
        if r.status_code >= 400:
            retry = r.headers.get("Retry-After")
            raise EngineRequestError(
                f"engine {self.url}: {call} -> HTTP {r.status_code}: {r.text[:500]}",
                status=r.status_code, retry_after_s=float(retry) if retry else None, url=self.url, call=call)
        return r.json()

    # -- serving -----------------------------------------------------------------------------------
    def health(self, timeout_s: float = 5.0) -> dict:
        return self._call("GET", "/health", timeout_s)

    def wait_ready(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep, poll_s: float = 0.2,
                   alive: Callable[[], bool] = lambda: True) -> dict:
        """Poll /health until it answers, the process dies (`alive`), or timeout_s passes."""
        deadline = clock() + timeout_s
        last: Exception | None = None
        while clock() < deadline:
            if not alive():
                raise EngineRequestError(f"engine {self.url} exited before it became healthy ({last})",
                                         url=self.url, call="start")
            try:
                return self.health(timeout_s=min(5.0, timeout_s))
            except EngineRequestError as e:
                last = e
            sleep(poll_s)
        raise EngineRequestError(f"engine {self.url} not healthy after {timeout_s:.0f} s: last error: {last}",
                                 url=self.url, call="start")

    def completions(self, prompts: list, *, n: int = 1, max_tokens: int = 16, temperature: float = 1.0,
                    seed: int | None = None, model: str = "policy", timeout_s: float | None = None) -> dict:
        body = {"model": model, "prompt": prompts, "n": n, "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed}
        return self._call("POST", "/v1/completions", timeout_s, json=body)

    # -- admin (the sync protocol) -----------------------------------------------------------------
    def version(self) -> int:
        return int(self._call("GET", "/admin/version")["version"])

    def drain(self, timeout_s: float) -> dict:
        return self._call("POST", "/admin/drain", timeout_s + 5.0, json={"timeout_s": timeout_s})

    def update_disk(self, path: str, timeout_s: float) -> dict:
        return self._call("POST", "/admin/update/disk", timeout_s, json={"path": path})

    def broadcast_join(self, addr: str, port: int, rank: int, world_size: int, generation: int,
                       timeout_s: float) -> dict:
        body = {"addr": addr, "port": port, "rank": rank, "world_size": world_size,
                "generation": generation, "timeout_s": timeout_s}
        return self._call("POST", "/admin/broadcast/join", timeout_s + 5.0, json=body)

    def update_broadcast(self, manifest: list[dict], bucket_bytes: int, timeout_s: float) -> dict:
        body = {"manifest": manifest, "bucket_bytes": bucket_bytes}
        return self._call("POST", "/admin/update/broadcast", timeout_s, json=body)

    def update_ipc(self, manifest: list[dict], bucket_bytes: int, handles: list[dict], timeout_s: float,
                   ready: dict | None = None) -> dict:
        body = {"manifest": manifest, "bucket_bytes": bucket_bytes, "handles": handles, "ready": ready,
                "timeout_s": timeout_s}
        return self._call("POST", "/admin/update/ipc", timeout_s, json=body)

    def checksums(self, timeout_s: float | None = None) -> dict[str, str]:
        return self._call("GET", "/admin/checksum", timeout_s)["checksums"]

    def verify(self, expected: dict[str, str], timeout_s: float) -> dict:
        return self._call("POST", "/admin/verify", timeout_s, json={"expected": expected})

    def rollback(self, timeout_s: float) -> dict:
        return self._call("POST", "/admin/rollback", timeout_s)

    def resume(self, version: int, timeout_s: float, unverified_ok: bool = False) -> dict:
        body = {"version": version, "unverified_ok": unverified_ok}
        return self._call("POST", "/admin/resume", timeout_s, json=body)

    def close(self) -> None:
        self._http.close()


@dataclass
class EngineProcess:
    """A server process started by `spawn_engine`; `stop()` ends it and its children (SIGTERM, then SIGKILL)."""

    proc: subprocess.Popen
    client: EngineClient
    log_path: Path

    @property
    def url(self) -> str:
        return self.client.url

    def stop(self, timeout_s: float = 10.0) -> int | None:
        # The vLLM engine's EngineCore and worker processes are the server's children: listed before
        # the server goes, and killed if its own shutdown did not take them along.
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        _, alive = psutil.wait_procs(children, timeout=timeout_s)
        for child in alive:
            log.warning("engine %s: child pid %d outlived the server; killing it", self.url, child.pid)
            with contextlib.suppress(psutil.Error):
                child.kill()
        self.client.close()
        return self.proc.returncode

"""`rollout.engine: vllm`: vLLM's own OpenAI server (vLLM's `api_server` main, what `vllm serve` runs, started
through rollout/vllm_api.py) in the rollout venv, with its RL routes on and rlslurm's trust boundary in front.

    proc = spawn_vllm_serve(model_dir, port=p, log_path=run.logs / "engine-0.log", secret_file=run.secret,
                            python=".venv-vllm/bin/python", tp=2)
    proc.client.completions(["2 + 3 ="], n=4, max_tokens=8)     # rollout/vllm_client.py VLLMServeClient

What the server is started with, and why:
- VLLM_SERVER_DEV_MODE=1: the RL routes (/pause, /resume, /init_weight_transfer_engine, /start_weight_update,
  /update_weights, /finish_weight_update, /weight_info, /weight_checker) and /collective_rpc.
- `--middleware rlslurm.rollout.vllm_serve.SecretGate`: vLLM's `--api-key` guards only /v1; those routes
  would be open to anyone who reaches the port (/collective_rpc calls any worker method by name). The gate is
  rlslurm/wire.py's Protect (every path but /health needs the job's secret, compared in constant time; the
  body is bounded and buffered before vLLM parses it), default deny (only the routes named in DATA_ROUTES and
  ADMIN_PATHS pass, whatever vLLM mounts; it logs what it found at startup), and the job's generation bounds
  by value on every data route's body (rollout/bounds.py: n, max_tokens, logprobs, prompts, ...: vLLM has no
  flag for them; prompt length is vLLM's own --max-model-len). The secret file's path comes in
  RLSLURM_SECRET_FILE, never the token (argv and env are visible to `ps`).
- `--weight-transfer-config {"backend": "rlslurm"}` (rollout/vllm_transfer.py, registered through vLLM's
  plugin entry point) and `--worker-extension-cls` rollout/vllm_verify.py WorkerChecks: VERIFY reads what
  every worker serves (rlslurm/rollout/vllm_client.py says why that and not /weight_checker alone).
- `-m rlslurm.rollout.vllm_api`: vLLM's main with uvicorn's HTTP protocol guarded (rlslurm/connguard.py: a
  deadline and a size bound on each request's head, one answer per connection without the secret, at most 64
  of those at once), which vLLM's own server options cannot express.
- `--tensor-parallel-size rollout.tp`; on CPU, TP > 1 needs each worker's OpenMP threads bound to cores of
  its own (VLLM_CPU_OMP_THREADS_BIND="0|1") and a small --gpu-memory-utilization (on CPU: the share of host
  memory it reserves), or vLLM refuses to start (shared/notes/vllm-rl-api.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from rlslurm import lifetime, secret, wire
from rlslurm.rollout import engine_guard
from rlslurm.rollout.bounds import Bounds
from rlslurm.rollout.client import EngineProcess, EngineRequestError

GATE = "rlslurm.rollout.vllm_serve.SecretGate"
API_MODULE = "rlslurm.rollout.vllm_api"
"""The module vLLM's server is started as: vLLM's main behind rlslurm's connection guard."""
WORKER_EXTENSION = "rlslurm.rollout.vllm_verify.WorkerChecks"

# What vLLM 0.32's OpenAI server mounts (VLLM_SERVER_DEV_MODE=1, a generate model; the gate logs the live list
# at startup, tests/vllm/test_vllm_bounds.py reads it): /health /load /version /kv_event_sources /metrics
# /tokenize /detokenize /v1/models /v1/systemone /ping /invocations /reset_prefix_cache /reset_mm_cache
# /reset_encoder_cache /collective_rpc /server_info /sleep /release_kv_cache_memory /wake_up /is_sleeping /pause
# /resume /abort_requests /is_paused /init_weight_transfer_engine /shutdown_weight_transfer_engine
# /start_weight_update /start_draft_weight_update /update_weights /finish_weight_update /update_weight_version
# /weight_info /weight_checker /get_world_size /v1/chat/completions /v1/chat/completions/batch /v1/responses
# /v1/responses/{response_id} /v1/responses/{response_id}/cancel /v1/completions /v1/messages
# /v1/messages/count_tokens /generative_scoring /scale_elastic_ep /is_scaling_elastic_ep
# /v1/{chat/completions,messages,completions,responses}/render /v1/{chat/completions,completions}/derender
# /inference/v1/generate /inference/v1/abort_requests /openapi.json /docs /docs/oauth2-redirect /redoc; a
# pooling model adds /pooling /classify /score /rerank /v1/embeddings ..., a speech model /v1/audio/* and a
# WebSocket. Only the routes below pass; every other one, and every WebSocket, is refused (403) even with the
# secret: a route vLLM adds later is closed until someone decides what it does.
DATA_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat", "/invocations": "any",
               "/tokenize": "tokenize", "/detokenize": "tokenize", "/v1/models": "none"}
"""Routes that generate or tokenize (and the model list): the data body limit, the job's bounds on their bodies
(rollout/bounds.py, by the body's shape; /invocations takes a chat or a completion body), open without the
secret when rollout.open_data_plane is true."""
DATA_PATHS = tuple(DATA_ROUTES)
ADMIN_PATHS = ("/pause", "/resume", "/is_paused", "/init_weight_transfer_engine", "/start_weight_update",
               "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_info", "/weight_checker",
               "/collective_rpc", "/abort_requests", "/metrics")
"""vLLM's RL routes rlslurm's weight sync and supervisor use (rollout/vllm_client.py): the secret, the admin limit."""
LIMITS_ENV = "RLSLURM_VLLM_LIMITS"
"""JSON {"max_n", "max_tokens", "max_prompts", "max_batch_rows", "max_body_bytes", "open_data", "guard"}: the gate's
bounds and the engine's phase guard (engine_guard.from_args's arguments), set by the launcher."""
ADMIN_BODY_BYTES = 64 << 20  # an update's manifest of many tensors
ENGINE_POLL_S = 0.5  # how often a /v1 request in flight asks whether vLLM's engine stopped


class SecretGate(wire.Protect):
    """ASGI middleware vLLM adds with `--middleware` (it passes only the app): the job's secret on every
    route but /health (and the data routes, on an open data plane), a route it does not know refused (403),
    bounded bodies, and the job's bounds by value on every data route's body (a 400 naming the bound, with or
    without the secret); a /v1 request still in flight when vLLM's engine stops is ended (503), see
    `_until_engine_stops`.
    In a job it also wears the engine's phase guard (rollout/engine_guard.py): the API server writes
    heartbeats/rollout-<rank>.json from vLLM's own event loop, as the transformers engine does from its."""

    def __init__(self, app):
        lifetime.bind_to_parent()  # in vLLM's API server process: it ends with whoever started it
        limits = json.loads(os.environ.get(LIMITS_ENV) or "{}")
        self.guard = engine_guard.from_args(**limits["guard"]) if limits.get("guard") else None
        self._ticker: asyncio.Future | None = None
        self.bounds = Bounds(**{k: int(limits[k]) for k in ("max_n", "max_tokens", "max_prompts", "max_batch_rows")
                                if k in limits})
        body = int(limits.get("max_body_bytes", 16 << 20))
        self.inner = app
        super().__init__(self._until_engine_stops, token=secret.from_env_or(None), open_paths=("/health",),
                         data_paths=DATA_PATHS,
                         open_data=bool(limits.get("open_data", False)),
                         max_body_bytes=lambda path: body if path in DATA_ROUTES else ADMIN_BODY_BYTES)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.inner(scope, self._starting(scope, receive), send)
        # Default deny reaches WebSockets too (vLLM serves some, e.g. realtime audio): the job uses none, and
        # Protect passes every scope that is not HTTP through (rlslurm's own servers have none).
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        return await super().__call__(scope, receive, send)

    def check_route(self, path: str) -> str | None:
        if path in DATA_ROUTES or path in ADMIN_PATHS or path in self.open_paths:
            return None
        return (f"{path} is not served through rlslurm's gate: vLLM's routes are closed but for the job's data "
                f"routes ({', '.join(DATA_ROUTES)}) and its weight-sync routes (rlslurm/rollout/vllm_serve.py)")

    def _starting(self, scope, receive):
        """`receive` of vLLM's lifespan: at startup it logs the routes vLLM mounted and what the gate does with
        each, and starts the heartbeat (with a phase guard); at shutdown it ends the heartbeat."""
        async def watched():
            message = await receive()
            if message["type"] == "lifespan.startup":
                paths = sorted({getattr(r, "path", "") for r in getattr(scope.get("app"), "routes", ())} - {""})
                kinds = {"data": [p for p in paths if p in DATA_ROUTES],
                         "admin": [p for p in paths if p in ADMIN_PATHS],
                         "open": [p for p in paths if p in self.open_paths]}
                kinds["refused"] = [p for p in paths if self.check_route(p) is not None]
                print(f"rlslurm gate routes: {json.dumps(kinds)}", file=sys.stderr, flush=True)
            if self.guard is None:
                return message
            if message["type"] == "lifespan.startup" and self._ticker is None:
                self._ticker = asyncio.ensure_future(engine_guard.beats(self.guard))
            elif message["type"] == "lifespan.shutdown" and self._ticker is not None:
                self._ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._ticker
                self.guard.close()
            return message
        return watched

    async def _until_engine_stops(self, scope, receive, send):
        """vLLM 0.32 on SIGTERM stops its engine (in-flight requests aborted in the EngineCore) and then waits,
        with no bound, for every HTTP connection to close; a request in flight never gets its answer (its
        output handler went with the engine), so the server lived as long as its slowest caller's timeout
        (measured: > 30 s after SIGTERM with a generation in flight; tests/vllm/test_vllm_trust.py). Each /v1
        request runs as a task that is cancelled, and answered 503, once vLLM's engine client says it errored
        or stopped (AsyncLLM.errored), which also ends requests to an EngineCore that died. (Every data route:
        /invocations generates as /v1/completions does.)"""
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if scope["type"] != "http" or scope["path"] not in DATA_ROUTES or engine is None:
            return await self.inner(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        task = asyncio.ensure_future(self.inner(scope, receive, tracked))
        while not (await asyncio.wait({task}, timeout=ENGINE_POLL_S))[0]:
            if getattr(engine, "errored", False):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                if not started:
                    await wire._reply(send, 503, "vLLM's engine stopped with this request in flight", "engine_stopped")
                return None
        return task.result()

    def check_body(self, path: str, body: bytes) -> str | None:
        shape = DATA_ROUTES.get(path)
        if shape is None or not body:
            return None  # an admin body (the job's own weight sync), or none
        return self.bounds.check(body, shape)


def serve_command(model_dir: str | Path, *, python: str, host: str, port: int, tp: int = 1, name: str = "policy",
                  dtype: str = "float32", max_model_len: int | None = None,
                  gpu_memory_utilization: float | None = None, extra_args: list[str] | None = None) -> list[str]:
    """argv of one vLLM OpenAI server: the main `vllm serve` runs (through rollout/vllm_api.py, which guards its
    connections first), so the venv's interpreter is explicit. Not `vllm.entrypoints.cli.main serve`: on vllm-cpu
    it stops at start (importlib.metadata finds no distribution named vllm: this one is vllm-cpu)."""
    cmd = [python, "-m", API_MODULE, "--model", str(model_dir),
           "--served-model-name", name, "--host", host, "--port", str(port), "--dtype", dtype,
           "--tensor-parallel-size", str(tp), "--middleware", GATE, "--worker-extension-cls", WORKER_EXTENSION,
           "--weight-transfer-config", json.dumps({"backend": "rlslurm"}), "--disable-uvicorn-access-log",
           # Eager: a compiled graph may bake the packed-weight handle in, and an update re-packs a new one.
           "--enforce-eager"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return cmd + list(extra_args or [])


def serve_env(*, secret_file: Path, tp: int, cpu: bool, limits: dict, kv_cache_gb: int = 1) -> dict[str, str]:
    env = {"VLLM_SERVER_DEV_MODE": "1", secret.ENV_VAR: str(secret_file), LIMITS_ENV: json.dumps(limits),
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))
            per = max(1, len(cores) // tp)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, cores[k * per:(k + 1) * per])) if per > 1 else str(cores[k * per])
                for k in range(tp))
    return env


def spawn_vllm_serve(model_dir: str | Path, *, port: int, log_path: str | Path, python: str,
                     host: str = "127.0.0.1", secret_file: str | Path | None = None, tp: int = 1,
                     name: str = "policy", limits: dict | None = None, cpu: bool = True,
                     ready_timeout_s: float = 300.0, timeout_s: float = 120.0,
                     gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                     extra_args: list[str] | None = None, env: dict[str, str] | None = None) -> EngineProcess:
    """Start vLLM's OpenAI server and wait until /health answers; the EngineProcess's client is a
    VLLMServeClient. `cpu`: the CPU backend's settings (KV cache space, thread binding per TP rank)."""
    from rlslurm.rollout.vllm_client import VLLMServeClient

    log_path = Path(log_path)
    secret_file = secret.ensure(secret_file or log_path.with_name(log_path.name + ".secret"))
    if cpu and tp > 1 and gpu_memory_utilization is None:
        gpu_memory_utilization = 0.1  # on CPU: the share of host memory it reserves; its default refuses
    cmd = serve_command(model_dir, python=python, host=host, port=port, tp=tp, name=name,
                        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                        extra_args=extra_args)
    full_env = {**os.environ, **serve_env(secret_file=secret_file, tp=tp, cpu=cpu, limits=limits or {}), **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**full_env, **lifetime.child_env()})
    client = VLLMServeClient(f"http://{host}:{port}", timeout_s, token=secret.read(secret_file), tp=tp)
    try:
        client.wait_ready(ready_timeout_s, alive=lambda: proc.poll() is None, poll_s=0.5)
    except EngineRequestError as e:
        proc.kill()
        tail = log_path.read_text(errors="replace")[-3000:]
        raise EngineRequestError(f"{e}\n--- tail of {log_path} ---\n{tail}", url=e.url, call=e.call) from None
    return EngineProcess(proc, client, log_path)


def limits_of(server_args: list[str]) -> dict:
    """The gate's bounds from rollout/server.py's flags (rollout.server_args: one source of the job's limits)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-n", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--max-prompts", type=int, default=Bounds.max_prompts)
    p.add_argument("--max-batch-rows", type=int, default=Bounds.max_batch_rows)
    p.add_argument("--max-body-mb", type=float, default=16.0)
    p.add_argument("--open-data-plane", action="store_true")
    engine_guard.add_args(p)
    known, _ = p.parse_known_args(server_args)  # the rest (prompt tokens, deadlines, ...) vLLM bounds itself
    guard = {"run_dir": known.run_dir, "rank": known.rank, "heartbeat_interval_s": known.heartbeat_interval_s,
             "phase_timeout_s": known.phase_timeout_s}
    return {"max_n": known.max_n, "max_tokens": known.max_tokens, "max_prompts": known.max_prompts,
            "max_batch_rows": known.max_batch_rows, "max_body_bytes": int(known.max_body_mb * 2**20),
            "open_data": known.open_data_plane, **({"guard": guard} if known.run_dir else {})}


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_share() -> float | None:
    # rollout.gpu_memory_utilization, handed to every engine in the environment (rlslurm/rl/engines.py).
    share = float(os.environ.get("RLSLURM_GPU_MEMORY_UTILIZATION", 0) or 0)
    return share or None


def spawn_for_server_args(model_dir: str | Path, *, server_args: list[str], env: dict[str, str] | None, tp: int,
                          **kwargs) -> EngineProcess:
    """`spawn_vllm_serve` for rlslurm/rollout/launcher.py's spawn_engine: the job's limits from its server flags."""
    cpu = not _on_gpu()
    share = None if cpu else (env or {}).get("RLSLURM_GPU_MEMORY_UTILIZATION") or _gpu_share()
    return spawn_vllm_serve(model_dir, limits=limits_of(server_args), env=env, tp=tp, cpu=cpu,
                            gpu_memory_utilization=float(share) if share else None, **kwargs)


if __name__ == "__main__":  # pragma: no cover - a manual start: python -m rlslurm.rollout.vllm_serve DIR PORT
    print(" ".join(serve_command(sys.argv[1], python=sys.executable, host="127.0.0.1", port=int(sys.argv[2]))))

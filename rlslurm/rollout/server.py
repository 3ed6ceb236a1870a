"""The rollout engine server: an OpenAI-compatible HTTP front of one engine, plus the admin side of
weight sync.

    python -m rlslurm.rollout.server --model DIR --port 8000 --secret-file RUN/secret [--host 127.0.0.1]

Serving: GET /v1/models, POST /v1/completions (the `openai` client works against it, the job's secret
as its api_key). Each response, and each choice in it, carries `policy_version`, the version of the
weights that generated it; the X-Policy-Version header repeats it. Concurrent requests with the same
sampling settings are batched into one `generate` call by a single batcher thread, so one batch never
straddles two versions.

Trust (rlslurm/wire.py): every route but GET /health needs `Authorization: Bearer <the job's secret>`
(401 without); `--open-data-plane` (rollout.open_data_plane) lets anyone reach /v1/*. Bodies are strict
(rollout/schema.py) and bounded; a request past a limit (n, max_tokens, prompts, prompt tokens against
the model's context, sequences per call, token ids in the vocabulary) is a 400 that names it
(batcher.Limits); a text prompt longer in bytes than its tokens could hold is refused before it is tokenized
(rlslurm/textbound.py). Connections are guarded before the secret (rlslurm/connguard.py). Each request
has a deadline (--request-timeout-s: 504 and its work dropped); a caller that disconnects has its work
dropped (queued: never run; generating: stopped at the next token).
/health answers 503 with a reason when work is pending and the generation loop has not stepped for
--stall-timeout-s. SIGTERM drops all work at once and the server exits within seconds.

Admin (used by rlslurm/sync/protocol.py): GET /admin/version, /admin/checksum; POST
/admin/drain (refuse new requests with 503 + Retry-After, wait for in-flight, bounded),
/admin/update/{disk,broadcast,ipc}, /admin/broadcast/join, /admin/verify, /admin/rollback,
/admin/resume. Updates are accepted only while drained, and resume is refused until the weights
loaded since the drain passed /admin/verify, whose expectation must name every served tensor: an
unverified update is never served. An update lands beside the served weights and is swapped in by
reference once verified (HFEngine adopts tensors; rlslurm/sync/landing.py); with --no-keep-previous it is
copied in place and a failed verify leaves the engine drained until a sync passes (no rollback).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from rlslurm import connguard, lifetime, secret, wire
from rlslurm.rollout import engine_guard, schema
from rlslurm.rollout.batcher import AdmissionGate, Batcher, Dropped, Job, Limits
from rlslurm.rollout.engine import Engine, HFEngine, SamplingParams, WeightLoadError
from rlslurm.sync import disk, ipc
from rlslurm.sync.broadcast import BroadcastGroup
from rlslurm.sync.checksum import checksums, compare, unnamed
from rlslurm.sync.landing import BufferPool, Landing
from rlslurm.textbound import longest_token_bytes

log = logging.getLogger("rlslurm.rollout.server")

DATA_PATHS = ("/v1/completions", "/v1/models")
ADMIN_BODY_BYTES = 64 << 20  # a manifest of schema.MAX_TENSORS tensors fits
POLL_S = 0.1  # how often a waiting request looks for its caller's disconnect
DIE_IN_SYNC_ENV = "RLSLURM_TEST_ENGINE_DIE_IN_SYNC"
"""Tests only: `<version>:[update:]<marker file>`: the first engine asked to drain for a sync (with `update:`, to
receive a broadcast update) while it serves `version` or later SIGKILLs itself there (once: it creates the marker
first, so its replacement syncs): an engine lost in the middle of a weight sync, which no outside timing can hit
reliably (a tiny model's sync takes milliseconds)."""


def _die_in_sync_if_asked(version: int | None, stage: str = "drain") -> None:
    fault = os.environ.get(DIE_IN_SYNC_ENV)
    if not fault or version is None:
        return
    at, _, marker = fault.partition(":")
    wanted = "drain"
    if marker.startswith("update:"):
        wanted, marker = "update", marker.removeprefix("update:")
    if stage == wanted and version >= int(at):
        try:
            open(marker, "x").close()
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _prompts(prompt) -> list:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class EngineServer:
    """The server's state: engine, admission gate, batcher, and the sync bookkeeping."""

    def __init__(self, engine: Engine, *, keep_previous: bool = True, limits: Limits | None = None,
                 request_timeout_s: float = 600.0, stall_timeout_s: float = 60.0, debug_stall_s: float = 0.0):
        self.engine = engine
        self.gate = AdmissionGate()
        self.limits = limits or Limits(context_tokens=engine.context_tokens, vocab_size=engine.vocab_size)
        self.per_token = longest_token_bytes(engine.tokenizer)  # bytes a token covers at most: checks text unread
        self.request_timeout_s, self.stall_timeout_s = request_timeout_s, stall_timeout_s
        self.batcher = Batcher(engine, max_batch_rows=self.limits.max_batch_rows, debug_stall_s=debug_stall_s)
        self.verified = True  # weights served == weights last verified (or loaded at start)
        self.group: BroadcastGroup | None = None
        # Staged: updates land beside the served weights and are swapped in once verified, so the
        # old version is the rollback and no snapshot is copied. Else copied in place, with no rollback.
        self.staged = keep_previous and engine.adopts_weights
        self.pool = BufferPool()
        self.landing: Landing | None = None  # the update since the drain, until verified or dropped

    # -- sync bookkeeping ------------------------------------------------------------------------
    def begin_update(self) -> Landing:
        if self.gate.state != "drained":
            raise HTTPException(409, f"updates need a drained engine; state is {self.gate.state!r}")
        if self.landing is not None:  # a retry replaces the attempt that failed its verify
            self.landing.drop()
        self.verified = False
        self.landing = Landing(self.engine, staged=self.staged, pool=self.pool)
        return self.landing

    def receive(self, transport_receive) -> dict:
        """Run one transport's engine side (`transport_receive(landing) -> bytes`) into a new landing."""
        landing = self.begin_update()
        t0 = time.monotonic()
        try:
            nbytes = transport_receive(landing)
            landing.finish()  # staged: the landed tensors' checksums, part of UPDATE
        except (WeightLoadError, ValueError, FileNotFoundError) as e:  # the update's fault, not the engine's
            raise HTTPException(400, f"{type(e).__name__}: {e}") from None
        return {"bytes": nbytes, "seconds": time.monotonic() - t0}

    def verify(self, expected: dict[str, str]) -> dict:
        actual = self.to_be_served()
        missing = unnamed(expected, actual)  # an empty or partial expectation must not pass
        problems = compare(expected, actual) + missing
        if not problems and self.landing is not None:
            self.landing.commit()  # staged: the verified tensors are served from now on
            self.landing = None
        self.verified = not problems
        if problems:
            log.error("verify FAILED: %d tensors differ, %d served ones not named; first %s",
                      len(problems) - len(missing), len(missing), problems[0])
        return {"ok": not problems, "mismatches": problems, "missing": len(missing), "checksums": actual}

    def to_be_served(self) -> dict[str, str]:
        """Checksums of what the engine serves once the landing (if any) is committed: the landed tensors
        as they landed, every other served tensor as it is."""
        landed = self.landing.checksums if self.landing is not None else None
        if landed is None:
            return self.engine.checksums()
        rest = {n: t for n, t in self.landing.served.items() if n not in landed}
        return {**checksums(rest.items()), **landed}

    def rollback(self) -> dict:
        if self.gate.state != "drained":
            raise HTTPException(409, f"rollback needs a drained engine; state is {self.gate.state!r}")
        if self.staged:
            if self.landing is not None:  # never swapped in: the served weights are the verified ones
                self.landing.drop()
                self.landing = None
            self.verified = True
            return {"ok": True, "version": self.engine.version, "mismatches": []}
        raise HTTPException(409, "no previous weights kept (--no-keep-previous): the engine stays drained "
                                 "until a sync passes verify")

    def load(self, named) -> int:
        try:
            return self.engine.load_weights(named)
        except WeightLoadError as e:
            raise HTTPException(400, str(e)) from None


def build_app(server: EngineServer, token: str, *, open_data: bool = False,
              max_body_bytes: int = 16 << 20, guard: Any = None) -> FastAPI:
    """The app of one engine: its routes behind the job's secret (rlslurm/wire.py). With a phase guard
    (diag/guard.py) the engine beats from its serving loop (rollout/engine_guard.py)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        server.batcher.start()
        ticker = asyncio.create_task(engine_guard.beats(guard)) if guard is not None else None
        yield
        if ticker is not None:
            ticker.cancel()
        server.batcher.stop()

    app = FastAPI(title="rlslurm rollout engine", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    wire.protect(app, token, data_paths=DATA_PATHS, open_data=open_data,
                 max_body_bytes=lambda path: ADMIN_BODY_BYTES if path.startswith("/admin/") else max_body_bytes)
    engine, gate, batcher = server.engine, server.gate, server.batcher

    @app.get("/health")
    def health():
        body = {"status": "ok", "state": gate.state, "version": engine.version, "in_flight": gate.in_flight,
                "verified": server.verified, "model": engine.model_name, "batches": batcher.batches,
                "steps": batcher.steps, "pending": batcher.pending(), "dropped": dict(batcher.dropped)}
        stalled = batcher.stalled(server.stall_timeout_s)
        if stalled:  # whoever polls /health (a client's wait_ready, a supervisor) sees a wedged engine
            return JSONResponse({**body, "status": "unhealthy", "reason": stalled}, status_code=503)
        return body

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "rlslurm", "policy_version": engine.version}]}

    @app.post("/v1/completions")
    async def completions(req: schema.CompletionRequest, request: Request):
        if req.stream:
            return _error(400, "stream=true is not supported by this engine")
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        # Length before tokens: a 15 MiB prompt cost 37 s and +4.1 GB in the tokenizer before this refused it.
        problem = server.limits.check_text(_prompts(req.prompt), max_tokens, server.per_token)
        if problem is not None:
            return _error(400, problem)
        try:  # tokenizing is CPU work: off the event loop
            prompts = await run_in_threadpool(lambda: [engine.encode(p) for p in _prompts(req.prompt)])
        except Exception as e:  # a prompt the tokenizer cannot take is the caller's error
            return _error(400, f"a prompt could not be tokenized: {type(e).__name__}")
        problem = server.limits.check(prompts, req.n, max_tokens)
        if problem is not None:
            return _error(400, problem)
        params = SamplingParams(n=req.n, temperature=float(req.temperature or 0.0), max_new_tokens=max_tokens,
                                seed=req.seed)
        if not gate.enter():
            return _error(503, f"engine is {gate.state} for a weight update; retry shortly",
                          headers={"Retry-After": "1"})
        try:
            job = batcher.submit(prompts, params, server.request_timeout_s)
        except Dropped as e:
            gate.leave()
            return _error(e.status, str(e))
        except BaseException:
            gate.leave()
            raise
        job.future.add_done_callback(lambda _: gate.leave())  # in-flight until generation really ended
        try:
            results = await _answer(batcher, job, request)
        except Dropped as e:
            return _error(e.status, str(e))
        except ValueError as e:
            return _error(400, str(e))
        if results is None:
            return _error(499, "client disconnected; its work was dropped")
        body = schema.completion_body(req, engine.model_name, results)
        return JSONResponse(body, headers={"X-Policy-Version": str(body["policy_version"])})

    @app.get("/admin/version")
    def version():
        return {"version": engine.version, "state": gate.state, "verified": server.verified}

    @app.post("/admin/drain")
    def drain(body: schema.Drain):
        _die_in_sync_if_asked(engine.version)
        started = time.monotonic()
        if not gate.drain(body.timeout_s):
            return _error(504, f"{gate.in_flight} requests still in flight after {body.timeout_s} s; "
                               "engine keeps refusing new ones")
        return {"state": gate.state, "waited_s": time.monotonic() - started, "version": engine.version}

    @app.post("/admin/update/disk")
    def update_disk(body: schema.UpdateDisk):
        return server.receive(lambda landing: disk.receive(body.path, landing))

    @app.post("/admin/broadcast/join")
    def broadcast_join(body: schema.BroadcastJoin):
        server.group = None
        try:
            server.group = BroadcastGroup.join(body.addr, body.port, body.rank, body.world_size, body.timeout_s,
                                               generation=body.generation, token=token)
        except (RuntimeError, ConnectionError) as e:  # the trainer's store unreachable or not the job's, a peer missing
            raise HTTPException(502, f"broadcast join failed: {e}") from None
        return {"rank": server.group.rank, "world_size": server.group.world_size}

    @app.post("/admin/update/broadcast")
    def update_broadcast(body: schema.UpdateBroadcast):
        if server.group is None:
            raise HTTPException(409, "no broadcast group: call /admin/broadcast/join first")
        group, manifest = server.group, [m.model_dump() for m in body.manifest]
        _die_in_sync_if_asked(engine.version, "update")
        try:
            return server.receive(lambda landing: group.receive(manifest, body.bucket_bytes, landing))
        except RuntimeError as e:
            server.group = None  # broken by a peer's failure: the trainer rebuilds it
            raise HTTPException(502, f"broadcast receive failed: {e}") from None

    @app.post("/admin/update/ipc")
    def update_ipc(body: schema.UpdateIpc):
        manifest, handles = [m.model_dump() for m in body.manifest], [h.model_dump() for h in body.handles]
        ready = body.ready.model_dump() if body.ready is not None else None
        return server.receive(lambda landing: ipc.receive(manifest, body.bucket_bytes, handles, landing,
                                                          ready=ready, timeout_s=body.timeout_s))

    @app.get("/admin/checksum")
    def checksum():
        return {"version": engine.version, "checksums": engine.checksums()}

    @app.post("/admin/verify")
    def verify(body: schema.Verify):
        return server.verify(body.expected)

    @app.post("/admin/rollback")
    def rollback():
        return server.rollback()

    @app.post("/admin/resume")
    def resume(body: schema.Resume):
        # unverified_ok comes only from a job that set sync.verify = false on purpose.
        if not server.verified and not body.unverified_ok:
            raise HTTPException(409, "weights loaded since the drain are not verified: refusing to serve them")
        if server.landing is not None:  # sync.verify = false, or a verified in-place landing: serve it
            server.landing.commit()
            server.landing = None
        engine.version = body.version
        gate.resume()
        return {"state": gate.state, "version": engine.version}

    return app


async def _answer(batcher: Batcher, job: Job, request: Request) -> list | None:
    """The job's result; Dropped (504) past its deadline; None once the caller disconnected. Either way
    the job is cancelled in the batcher: queued it never runs, running it stops at the next token."""
    future = asyncio.wrap_future(job.future)
    # A result nobody awaits any more must not be logged as "never retrieved".
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    while True:
        left = job.deadline - batcher.clock()
        done, _ = await asyncio.wait({future}, timeout=max(0.0, min(POLL_S, left)))
        if done:
            return future.result()
        if left <= 0:
            error = Dropped("request ran past its deadline (rollout.request_timeout_s); its work was dropped", 504)
            batcher.cancel(job, error, "deadline")
            raise error
        if await request.is_disconnected():
            batcher.cancel(job, Dropped("client disconnected", 499), "disconnected")
            return None


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "engine_unavailable"
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--debug-stall-s", type=float, default=0.0,
                   help="tests only: every generate call first waits this long without progress (a wedged engine)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind: the one the job's peers use")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--secret-file", default=None,
                   help=f"the job's secret (<run>/secret); default: the file ${secret.ENV_VAR} names")
    p.add_argument("--open-data-plane", action="store_true",
                   help="serve /v1/* to callers without the secret (rollout.open_data_plane)")
    p.add_argument("--name", default=None, help="model id shown by /v1/models (default: the dir's name)")
    p.add_argument("--version", type=int, default=0, help="policy version of the weights in --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--lora", default=None, help="train.lora as JSON (rlslurm/lora.py): serve the base with the "
                                                "trainer's LoRA layers, synced as adapters")
    limits = Limits()
    p.add_argument("--max-n", type=int, default=limits.max_n, help="samples per prompt (rollout.max_n)")
    p.add_argument("--max-tokens", type=int, default=limits.max_tokens,
                   help="tokens per sample (rollout.max_new_tokens)")
    p.add_argument("--max-prompts", type=int, default=limits.max_prompts,
                   help="prompts per request (rollout.max_prompts_per_request)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="tokens per prompt (rollout.max_prompt_tokens; default: the model's context)")
    p.add_argument("--max-batch-rows", type=int, default=limits.max_batch_rows,
                   help="prompts x n per request and per generate call (rollout.max_batch_rows)")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest /v1 request body, MiB")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="deadline of one request, queued and generating (rollout.request_timeout_s)")
    p.add_argument("--stall-timeout-s", type=float, default=60.0,
                   help="/health is 503 when work is pending and no token came for this long (rollout.stall_timeout_s)")
    engine_guard.add_args(p)
    p.add_argument("--no-keep-previous", action="store_true",
                   help="do not keep a host copy of the weights for rollback (large models)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    lifetime.bind_to_parent()  # a SIGKILLed parent (trainer rank 0, the engine supervisor) takes it along
    token = secret.from_env_or(args.secret_file)  # before the model loads: a missing secret fails fast
    if args.threads:
        torch.set_num_threads(args.threads)
    lora = None
    if args.lora:
        from rlslurm.lora import LoraConfig

        lora = LoraConfig.from_flag(args.lora)
    engine: Engine = HFEngine(args.model, device=args.device, dtype=args.dtype, version=args.version,
                              name=args.name, lora=lora)
    limits = Limits(max_n=args.max_n, max_tokens=args.max_tokens, max_prompts=args.max_prompts,
                    max_prompt_tokens=args.max_prompt_tokens, max_batch_rows=args.max_batch_rows,
                    context_tokens=engine.context_tokens, vocab_size=engine.vocab_size)
    server = EngineServer(engine, keep_previous=not args.no_keep_previous, limits=limits,
                          request_timeout_s=args.request_timeout_s, stall_timeout_s=args.stall_timeout_s,
                          debug_stall_s=args.debug_stall_s)
    log.info("serving %s (version %d) on http://%s:%d; %s", engine.model_name, engine.version, args.host,
             args.port, limits)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it under the handler found at start:
    # unless a caller installed its own (rlslurm/rl/roles.py's rollout component), make that an exit that runs
    # `finally`, so the engine's child processes (vLLM) go with us.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    guard = engine_guard.from_args(args.run_dir, args.rank, args.heartbeat_interval_s, args.phase_timeout_s)
    app = build_app(server, token, open_data=args.open_data_plane, max_body_bytes=int(args.max_body_mb * 2**20),
                    guard=guard)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=STOP_GRACE_S, http=connguard.protocol(token))
    try:
        _StoppingServer(config, server.batcher).run()
    finally:
        log.info("server stopped; closing the engine")
        engine.close()
        if guard is not None:
            guard.close()


STOP_GRACE_S = 2
"""Seconds uvicorn waits for responses in flight at a SIGTERM; the work behind them is dropped at once."""


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, whose SIGTERM / SIGINT first drops every queued and running generation: the
    requests in flight answer 503 at once, so the graceful shutdown is seconds, not a whole generation."""

    def __init__(self, config: uvicorn.Config, batcher: Batcher):
        super().__init__(config)
        self.batcher = batcher

    def handle_exit(self, sig, frame) -> None:
        # A signal handler runs between two bytecodes of the main thread, which may hold the batcher's
        # lock: abort from a thread of its own.
        threading.Thread(target=self.batcher.abort_all, args=(f"engine server stopping ({signal.Signals(sig).name})",),
                         name="abort-on-signal", daemon=True).start()
        super().handle_exit(sig, frame)


def run_as_program(argv: list[str] | None = None) -> None:
    """`python -m rlslurm.rollout.server`: main(), then leave at once with its exit code. The interpreter's
    own exit runs a garbage collection over everything torch, transformers and vLLM imported: measured
    4-9 s after the engine was already closed, which would make a SIGTERM anything but prompt."""
    from rlslurm.errors import RlslurmError

    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except RlslurmError as e:  # e.g. no secret file: one clear line, no traceback
        print(f"rlslurm.rollout.server: error: {e}", file=sys.stderr)
        code = e.exit_code
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_as_program()

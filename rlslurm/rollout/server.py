"""The rollout engine server: an OpenAI-compatible HTTP front of one engine, plus the admin side of
weight sync.

    python -m rlslurm.rollout.server --model DIR --port 8000 [--host 127.0.0.1] [--version 0]
    .venv-vllm/bin/python -m rlslurm.rollout.server --engine vllm --model DIR --port 8000

Serving: GET /v1/models, POST /v1/completions (the `openai` client works against it). Each response,
and each choice in it, carries `policy_version`, the version of the weights that generated it; the
X-Policy-Version header repeats it. Concurrent requests with the same sampling settings are batched
into one `generate` call by a single batcher thread, so one batch never straddles two versions.

Admin (used by rlslurm/sync/protocol.py): GET /health, /admin/version, /admin/checksum; POST
/admin/drain (refuse new requests with 503 + Retry-After, wait for in-flight, bounded),
/admin/update/{disk,broadcast,ipc}, /admin/broadcast/join, /admin/verify, /admin/rollback,
/admin/resume. Updates are accepted only while drained, and resume is refused until the weights
loaded since the drain passed /admin/verify: an unverified update is never served. An update lands
beside the served weights and is swapped in by reference once verified when the engine can adopt
tensors (HFEngine), else it is copied in place over a rollback snapshot (rlslurm/sync/landing.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from typing import Any

import torch
import uvicorn
from fastapi import Body, FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from rlslurm.rollout.batcher import AdmissionGate, Batcher
from rlslurm.rollout.engine import Engine, HFEngine, SamplingParams, WeightLoadError
from rlslurm.sync import disk, ipc
from rlslurm.sync.broadcast import BroadcastGroup
from rlslurm.sync.checksum import checksums, compare
from rlslurm.sync.landing import BufferPool, Landing

log = logging.getLogger("rlslurm.rollout.server")


class CompletionRequest(BaseModel):
    # The openai client sends more fields than we use (top_p, stream, ...): accept and ignore them.
    model_config = ConfigDict(extra="allow")
    model: str = ""
    prompt: str | list[str] | list[int] | list[list[int]]
    n: int = 1
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stream: bool | None = False


def _prompts(prompt) -> list:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class EngineServer:
    """The server's state: engine, admission gate, batcher, and the sync bookkeeping."""

    def __init__(self, engine: Engine, *, keep_previous: bool = True, max_batch_prompts: int = 256):
        self.engine = engine
        self.gate = AdmissionGate()
        self.batcher = Batcher(engine, max_batch_prompts=max_batch_prompts)
        self.keep_previous = keep_previous
        self.previous: dict[str, torch.Tensor] | None = None  # last verified weights, for rollback
        self.verified = True  # weights served == weights last verified (or loaded at start)
        self.group: BroadcastGroup | None = None
        # Staged: updates land beside the served weights and are swapped in once verified, so the
        # old version is the rollback and no snapshot is copied. Else copied in place.
        self.staged = keep_previous and engine.adopts_weights
        self.pool = BufferPool()
        self.landing: Landing | None = None  # the update since the drain, until verified or dropped

    # -- sync bookkeeping ------------------------------------------------------------------------
    def begin_update(self) -> Landing:
        if self.gate.state != "drained":
            raise HTTPException(409, f"updates need a drained engine; state is {self.gate.state!r}")
        if self.landing is not None:  # a retry replaces the attempt that failed its verify
            self.landing.drop()
        if not self.staged and self.verified and self.keep_previous:
            self.previous = self.engine.snapshot()
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
        except WeightLoadError as e:
            raise HTTPException(400, str(e)) from None
        return {"bytes": nbytes, "seconds": time.monotonic() - t0}

    def verify(self, expected: dict[str, str]) -> dict:
        landed = self.landing.checksums if self.landing is not None else None
        actual = landed if landed is not None else self.engine.checksums()
        problems = compare(expected, actual)
        if not problems and self.landing is not None:
            self.landing.commit()  # staged: the verified tensors are served from now on
            self.landing = None
        self.verified = not problems
        if problems:
            log.error("verify FAILED: %d tensors differ, first %s", len(problems), problems[0])
        return {"ok": not problems, "mismatches": problems, "checksums": actual}

    def rollback(self) -> dict:
        if self.gate.state != "drained":
            raise HTTPException(409, f"rollback needs a drained engine; state is {self.gate.state!r}")
        if self.staged:
            if self.landing is not None:  # never swapped in: the served weights are the verified ones
                self.landing.drop()
                self.landing = None
            self.verified = True
            return {"ok": True, "version": self.engine.version, "mismatches": []}
        if self.previous is None:
            raise HTTPException(409, "no previous weights kept (--no-keep-previous) or nothing to undo")
        self.landing = None
        self.engine.restore(self.previous)
        problems = compare(checksums(self.previous.items()), self.engine.checksums())
        self.verified = not problems
        return {"ok": not problems, "version": self.engine.version, "mismatches": problems}

    def load(self, named) -> int:
        try:
            return self.engine.load_weights(named)
        except WeightLoadError as e:
            raise HTTPException(400, str(e)) from None


def build_app(server: EngineServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        server.batcher.start()
        yield
        server.batcher.stop()

    app = FastAPI(title="rlslurm rollout engine", lifespan=lifespan)
    engine, gate = server.engine, server.gate

    @app.get("/health")
    def health():
        return {"status": "ok", "state": gate.state, "version": engine.version,
                "in_flight": gate.in_flight, "verified": server.verified, "model": engine.model_name,
                "batches": server.batcher.batches}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "rlslurm", "policy_version": engine.version}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.stream:
            return _error(400, "stream=true is not supported by this engine")
        prompts = _prompts(req.prompt)
        if not prompts or req.n < 1 or (req.max_tokens is not None and req.max_tokens < 1):
            return _error(400, "need at least one prompt, n >= 1 and max_tokens >= 1")
        params = SamplingParams(n=req.n, temperature=float(req.temperature or 0.0),
                                max_new_tokens=req.max_tokens or 16, seed=req.seed)
        if not gate.enter():
            return _error(503, f"engine is {gate.state} for a weight update; retry shortly",
                          headers={"Retry-After": "1"})
        try:
            future = server.batcher.submit(prompts, params)
        except BaseException:
            gate.leave()
            raise
        future.add_done_callback(lambda _: gate.leave())  # in-flight until generation really ended
        try:
            results = await asyncio.wrap_future(future)
        except ValueError as e:
            return _error(400, str(e))
        return _openai_response(req, engine.model_name, results)

    @app.get("/admin/version")
    def version():
        return {"version": engine.version, "state": gate.state, "verified": server.verified}

    @app.post("/admin/drain")
    def drain(timeout_s: float = Body(30.0, embed=True)):
        started = time.monotonic()
        if not gate.drain(timeout_s):
            return _error(504, f"{gate.in_flight} requests still in flight after {timeout_s} s; "
                               "engine keeps refusing new ones")
        return {"state": gate.state, "waited_s": time.monotonic() - started, "version": engine.version}

    @app.post("/admin/update/disk")
    def update_disk(path: str = Body(..., embed=True)):
        return server.receive(lambda landing: disk.receive(path, landing))

    @app.post("/admin/broadcast/join")
    def broadcast_join(body: dict = Body(...)):
        server.group = None
        server.group = BroadcastGroup.join(body["addr"], int(body["port"]), int(body["rank"]),
                                           int(body["world_size"]), float(body["timeout_s"]),
                                           generation=int(body.get("generation", 0)))
        return {"rank": server.group.rank, "world_size": server.group.world_size}

    @app.post("/admin/update/broadcast")
    def update_broadcast(body: dict = Body(...)):
        if server.group is None:
            raise HTTPException(409, "no broadcast group: call /admin/broadcast/join first")
        group = server.group
        try:
            return server.receive(lambda landing: group.receive(body["manifest"], int(body["bucket_bytes"]), landing))
        except RuntimeError as e:
            server.group = None  # broken by a peer's failure: the trainer rebuilds it
            raise HTTPException(502, f"broadcast receive failed: {e}") from None

    @app.post("/admin/update/ipc")
    def update_ipc(body: dict = Body(...)):
        return server.receive(lambda landing: ipc.receive(
            body["manifest"], int(body["bucket_bytes"]), body["handles"], landing,
            ready=body.get("ready"), timeout_s=float(body.get("timeout_s", 60.0))))

    @app.get("/admin/checksum")
    def checksum():
        return {"version": engine.version, "checksums": engine.checksums()}

    @app.post("/admin/verify")
    def verify(expected: dict[str, str] = Body(..., embed=True)):
        return server.verify(expected)

    @app.post("/admin/rollback")
    def rollback():
        return server.rollback()

    @app.post("/admin/resume")
    def resume(version: int = Body(..., embed=True), unverified_ok: bool = Body(False, embed=True)):
        # unverified_ok comes only from a job that set sync.verify = false on purpose.
        if not server.verified and not unverified_ok:
            raise HTTPException(409, "weights loaded since the drain are not verified: refusing to serve them")
        if server.landing is not None:  # sync.verify = false, or a verified in-place landing: serve it
            server.landing.commit()
            server.landing = None
        engine.version = version
        gate.resume()
        return {"state": gate.state, "version": engine.version}

    return app


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "engine_unavailable"
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def _openai_response(req: CompletionRequest, model: str, results: list) -> JSONResponse:
    choices: list[dict[str, Any]] = []
    versions = set()
    prompt_tokens = completion_tokens = 0
    for per_prompt in results:
        prompt_tokens += len(per_prompt[0].prompt_token_ids)
        for c in per_prompt:
            versions.add(c.version)
            completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = {"tokens": [str(t) for t in c.token_ids], "token_logprobs": c.logprobs,
                            "top_logprobs": None, "text_offset": None}
            choices.append({"index": len(choices), "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": logprobs, "token_ids": c.token_ids, "token_logprobs": c.logprobs,
                            "policy_version": c.version})
    (version,) = versions  # one batch, one version: the batcher never mixes them
    body = {"id": f"cmpl-{time.time_ns():x}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or model, "choices": choices, "policy_version": version,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return JSONResponse(body, headers={"X-Policy-Version": str(version)})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="hf = transformers (rollout/engine.py); vllm = vLLM (rollout/vllm_engine.py, "
                        "needs the .venv-vllm interpreter: sbatch/install_vllm_cpu.sh)")
    p.add_argument("--debug-skip-repack", action="store_true",
                   help="vllm only, tests only: load updates without re-packing the CPU GEMM weights "
                        "(a silent half-update that VERIFY must catch)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default=None, help="model id shown by /v1/models (default: the dir's name)")
    p.add_argument("--version", type=int, default=0, help="policy version of the weights in --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--max-batch-prompts", type=int, default=256)
    p.add_argument("--no-keep-previous", action="store_true",
                   help="do not keep a host copy of the weights for rollback (large models)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine == "vllm":
        from rlslurm.rollout.vllm_engine import VLLMEngine

        engine: Engine = VLLMEngine(args.model, dtype=args.dtype, version=args.version, name=args.name,
                                    skip_repack=args.debug_skip_repack)
    else:
        engine = HFEngine(args.model, device=args.device, dtype=args.dtype, version=args.version,
                          name=args.name)
    server = EngineServer(engine, keep_previous=not args.no_keep_previous,
                          max_batch_prompts=args.max_batch_prompts)
    log.info("serving %s (version %d) on http://%s:%d", engine.model_name, engine.version, args.host, args.port)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it under the handler found at start:
    # unless a caller installed its own (rlslurm/rl/roles.py's rollout component), make that an exit that runs
    # `finally`, so the engine's child processes (vLLM) go with us.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()


if __name__ == "__main__":
    main()

"""The controller's client of vLLM's own OpenAI server (rollout/vllm_serve.py): the EngineClient surface that
rlslurm/sync/protocol.py and rl/controller.py call, on vLLM's routes.

    serving   POST /v1/completions (return_token_ids, logprobs) -> choices with token_ids, token_logprobs,
              and policy_version: vLLM's weight version (GET /weight_info) that produced the response
    DRAIN     POST /pause?mode=wait        in-flight requests finish; new ones wait in vLLM until /resume
    UPDATE    POST /init_weight_transfer_engine (broadcast: join the trainer's group), /start_weight_update,
              /update_weights {kind: broadcast | disk | ipc} (disk: once per shard, as the trainer finishes
              it), /finish_weight_update (rollout/vllm_transfer.py)
    VERIFY    POST /collective_rpc rlslurm_checksums: every worker's checksums of what it serves
    RESUME    POST /update_weight_version {version}, POST /resume

The version of a response. /v1/completions does not say which weights made it, so it is bracketed: the
weight version is read before and after the request; equal, every token came from that version, because
the weights change only between /pause (which returned only after every request in flight finished) and
/resume, and the version label changes in that window too (at RESUME, after VERIFY passed). Unequal
(a sync ran meanwhile), the tokens may come from either version: the request is sent again, never
stamped with a guess.

VERIFY, and why not vLLM's /weight_checker alone: on the CPU backend the checker hashes an empty buffer
for every re-packed linear weight (shared/notes/vllm-rl-api.md), and its baseline is in vLLM's own scheme,
so the trainer could not supply it. Instead every worker checksums, in rlslurm/sync/checksum.py's scheme,
each tensor as it is *served*: a linear layer's weight read back through the layer's own GEMM (the packed
copy the forward pass uses), fused projections cut back into their Hugging Face parts, under HF names
(rollout/vllm_verify.py WorkerChecks). The reference is the trainer's checksums of the tensors it sent,
taken from its own memory, never from an engine. A half-applied update (some tensors or layers loaded,
others not; parameters loaded but never re-packed) leaves some served tensor with the old bytes, and a
stale engine serves all old bytes: either way that tensor's checksum differs from the trainer's, named.
The expectation must name every served tensor (a tensor the trainer left out is a mismatch too).

No snapshot: the engine keeps only the weights it serves. A failed VERIFY leaves it paused (nothing
unverified is served: RESUME is refused by this client) and is repaired by sending again from the trainer.
"""

from __future__ import annotations

import time

import httpx

from rlslurm.rollout.client import EngineClient, EngineRequestError
from rlslurm.sync.checksum import compare, unnamed

INITIAL_VERSION = "default"
"""vLLM's weight version before any update: policy version 0 (the weights the server started from)."""
RETRIES = 8  # a response bracketed by two versions is asked again; more than a few means syncs back to back


class VLLMServeClient(EngineClient):
    """One vLLM OpenAI server; `tp` is its tensor-parallel size (each worker is a rank of a broadcast group)."""

    def __init__(self, url: str, timeout_s: float = 120.0, *, token: str | None = None, tp: int = 1):
        super().__init__(url, timeout_s, token=token)
        self.group_ranks = tp
        self.verified = True  # what it serves passed VERIFY (or is what it started with)

    def __repr__(self) -> str:
        return f"VLLMServeClient({self.url!r}, tp={self.group_ranks})"

    def _post(self, path: str, timeout_s: float | None = None, **body) -> dict:
        return self._call("POST", path, timeout_s, json=body) if body else self._call("POST", path, timeout_s)

    # -- serving -----------------------------------------------------------------------------------
    def health(self, timeout_s: float = 5.0) -> dict:
        """vLLM's /health (an empty 200), plus what the sync tests read: state, version, verified."""
        self.live(timeout_s)
        paused = self._call("GET", "/is_paused", timeout_s)["is_paused"]
        return {"status": "ok", "state": "drained" if paused else "serving", "version": self.version(),
                "verified": self.verified}

    def _get_text(self, path: str, timeout_s: float) -> str:
        """GET a route that answers plain text (vLLM's /health: empty; /metrics: Prometheus text), bounded."""
        try:
            r = self._http.get(path, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise EngineRequestError(f"engine {self.url}: GET {path} failed: {type(e).__name__}: {e}",
                                     url=self.url, call=f"GET {path}") from None
        if r.status_code != 200:
            raise EngineRequestError(f"engine {self.url}: GET {path} -> HTTP {r.status_code}: {r.text[:300]}",
                                     status=r.status_code, url=self.url, call=f"GET {path}")
        return r.text

    def metrics(self, timeout_s: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
        """vLLM's Prometheus /metrics, parsed (rollout/vllm_metrics.py)."""
        from rlslurm.rollout.vllm_metrics import parse

        return parse(self._get_text("/metrics", timeout_s))

    def live(self, timeout_s: float = 5.0) -> None:
        """vLLM's own /health (200 while its API server runs and its engine is not dead), nothing else: the
        supervisor's check, which must not wait on the EngineCore (health() asks it whether it is paused)."""
        self._get_text("/health", timeout_s)

    def progress(self, timeout_s: float = 5.0):
        """Requests running and tokens generated so far, from vLLM's /metrics (rollout/vllm_metrics.py Progress)."""
        from rlslurm.rollout.vllm_metrics import Progress

        return Progress.of(self.metrics(timeout_s))

    def wait_ready(self, timeout_s: float, **kwargs) -> dict:
        kwargs.setdefault("poll_s", 0.5)
        return super().wait_ready(timeout_s, **kwargs)

    def completions(self, prompts: list, *, n: int = 1, max_tokens: int = 16, temperature: float = 1.0,
                    seed: int | None = None, model: str = "policy", timeout_s: float | None = None) -> dict:
        body = {"model": model, "prompt": prompts, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "logprobs": 0, "return_token_ids": True}
        for _ in range(RETRIES):
            before = self.version()
            out = self._call("POST", "/v1/completions", timeout_s, json=body)
            if any(c.get("finish_reason") == "abort" for c in out.get("choices", [])):
                # vLLM answers 200 for requests its engine aborted (shutdown, abort_requests): truncated samples.
                raise EngineRequestError(f"engine {self.url}: vLLM aborted the request (finish_reason abort)",
                                         status=503, url=self.url, call="POST /v1/completions")
            if self.version() == before:
                return _stamped(out, before)
        raise EngineRequestError(f"engine {self.url}: the weight version changed during each of {RETRIES} "
                                 "tries of one request", url=self.url, call="POST /v1/completions")

    # -- the sync protocol ---------------------------------------------------------------------------
    def version(self) -> int:
        label = self._call("GET", "/weight_info")["weight_version"]
        return 0 if label == INITIAL_VERSION else int(label)

    def drain(self, timeout_s: float) -> dict:
        started = time.monotonic()
        self._call("POST", "/pause", timeout_s + 5.0, params={"mode": "wait"})
        return {"state": "drained", "waited_s": time.monotonic() - started, "version": self.version()}

    def _update(self, update_info: dict, timeout_s: float) -> dict:
        started = time.monotonic()
        self.verified = False  # from the first byte on, what it holds is unverified
        self._post("/start_weight_update", timeout_s)
        self._post("/update_weights", timeout_s, update_info=update_info)
        self._post("/finish_weight_update", timeout_s)  # the version label is set at RESUME, once verified
        return {"seconds": time.monotonic() - started}

    def update_disk(self, path: str, timeout_s: float) -> dict:
        return self._update({"kind": "disk", "path": path}, timeout_s)

    # A disk update shard by shard (rlslurm/sync/disk.py DiskTransport): the worker loads shard k while the
    # trainer writes shard k + 1; vLLM's layerwise reload spans the update_weights calls between start and finish.
    def begin_disk_update(self, timeout_s: float) -> None:
        self.verified = False
        self._post("/start_weight_update", timeout_s)

    def update_disk_shard(self, path: str, files: list[str], timeout_s: float) -> None:
        self._post("/update_weights", timeout_s, update_info={"kind": "disk", "path": path, "files": files})

    def finish_disk_update(self, timeout_s: float) -> None:
        self._post("/finish_weight_update", timeout_s)

    def broadcast_join(self, addr: str, port: int, rank: int, world_size: int, generation: int,
                       timeout_s: float) -> dict:
        info = {"addr": addr, "port": port, "rank_offset": rank, "world_size": world_size,
                "generation": generation, "timeout_s": timeout_s}
        self._post("/init_weight_transfer_engine", timeout_s + 5.0, init_info=info)
        return {"rank": rank, "world_size": world_size}

    def update_broadcast(self, manifest: list[dict], bucket_bytes: int, timeout_s: float) -> dict:
        return self._update({"kind": "broadcast", "manifest": manifest, "bucket_bytes": bucket_bytes}, timeout_s)

    def update_ipc(self, manifest: list[dict], bucket_bytes: int, handles: list[dict], timeout_s: float,
                   ready: dict | None = None) -> dict:
        if self.group_ranks != 1:
            raise EngineRequestError(f"engine {self.url}: ipc sync reaches one worker per FIFO; TP "
                                     f"{self.group_ranks} needs broadcast or disk", url=self.url, call="update_ipc")
        return self._update({"kind": "ipc", "manifest": manifest, "bucket_bytes": bucket_bytes,
                             "handles": handles, "ready": ready, "timeout_s": timeout_s}, timeout_s)

    def checksums(self, timeout_s: float | None = None) -> dict[str, str]:
        """Checksums of what every worker serves, merged; a tensor whose TP ranks disagree is a mismatch."""
        results = self._post("/collective_rpc", timeout_s, method="rlslurm_checksums")["results"]
        merged: dict[str, str] = {}
        for worker in results:
            for name, value in worker.items():
                if merged.setdefault(name, value) != value:
                    merged[name] = f"TP ranks differ: {merged[name]} | {value}"
        return merged

    def verify(self, expected: dict[str, str], timeout_s: float) -> dict:
        actual = self.checksums(timeout_s)
        missing = unnamed(expected, actual)
        problems = compare(expected, actual) + missing
        self.verified = not problems
        return {"ok": not problems, "mismatches": problems, "missing": len(missing), "checksums": actual}

    def rollback(self, timeout_s: float) -> dict:
        """Nothing to roll back to: the engine keeps no copy of old weights. It stays paused (RESUME refuses
        it) until a sync from the trainer passes VERIFY."""
        return {"ok": False, "version": self.version(), "mismatches": [],
                "reason": "no snapshot on a vLLM engine: stays paused until the trainer sends again"}

    def resume(self, version: int, timeout_s: float, unverified_ok: bool = False) -> dict:
        if not self.verified and not unverified_ok:
            raise EngineRequestError(f"engine {self.url}: weights loaded since the drain are not verified: "
                                     "refusing to serve them", status=409, url=self.url, call="POST /resume")
        self._post("/update_weight_version", timeout_s, new_version=str(version))
        self._post("/resume", timeout_s)
        return {"state": "serving", "version": version}


def _stamped(out: dict, version: int) -> dict:
    """vLLM's completion in the shape the controller reads (rollout/server.py's): per choice token_ids,
    token_logprobs and policy_version; the response's policy_version."""
    for choice in out["choices"]:
        logprobs = choice.get("logprobs") or {}
        choice["token_logprobs"] = logprobs.get("token_logprobs")
        choice["policy_version"] = version
    out["policy_version"] = version
    return out

"""The reward service: a resident FastAPI app that scores batches concurrently.

    python -m rlslurm.reward.service --port 8321 --secret-file RUN/secret --config job.yaml   # its `reward:`
    python -m rlslurm.reward.service --port 8321 --secret-file F --scorer judge --endpoint http://127.0.0.1:9000/v1

    GET  /health    {"status": "ok", "pid", "scorer", "inflight", "sandbox_mode"}             (open to all)
    POST /score     {"items": [{"id", "response", "prompt", "reference", "reference_is_json", "tests",
                               "entry_point", "data_source", "extra"}, ...]}
                 -> {"results": [{"id", "score", "status", "reason"}, ...]}   status: scored | unscored | error
    GET  /metrics   Prometheus text format

Trust (rlslurm/wire.py): /score and /metrics need `Authorization: Bearer <the job's secret>` (401
without); `reward.open_data_plane` opens /score. A body is strict and bounded: at most
`reward.max_items_per_request` items (400 past it), an item over `reward.max_item_bytes` comes back
unscored without reaching its scorer; each item is scored within `reward.timeout_s` (then `error`);
a `reason` is cut to items.MAX_REASON_CHARS.

Items of one batch, and of all batches in flight, are scored at once up to `reward.concurrency`
(an asyncio semaphore): a 2 s judge scores 512 responses at concurrency 64 in ~16 s, not 1024 s.
`unscored` means the scorer decided it cannot score (a judge reply without a mark); `error` means
its upstream failed, and the client may retry. The supervisor (supervisor.py) keeps it alive.

With `--run-dir` it wears the ops kit's phase guard as role `reward`, rank 0 (heartbeats/reward-0.json,
a restarted service takes the file over): phase `score` while items are in flight, progress at every
item and batch scored; phase `idle` otherwise, with a beat every `diag.heartbeat_interval_s` from a
task on the service's own event loop, so an idle service looks alive and a wedged loop stops beating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import click
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from rlslurm import connguard, lifetime, secret, wire
from rlslurm.configfile import load_mapping, read_yaml
from rlslurm.diag.config import DiagConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import Item
from rlslurm.reward.scorers import CodeScorer, JudgeScorer, ShardedHttp, close_scorer, make_scorer, score_bounded
from rlslurm.reward.workers import WorkerFailed

log = logging.getLogger(__name__)


_TEXT = 1 << 24  # structural cap per field; reward.max_item_bytes is the real limit


class ItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(max_length=256)
    response: str = Field(max_length=_TEXT)
    prompt: str = Field("", max_length=_TEXT)
    reference: str = Field("", max_length=_TEXT)
    reference_is_json: bool = False
    tests: str = Field("", max_length=_TEXT)
    entry_point: str = Field("", max_length=256)
    data_source: str = Field("", max_length=256)
    extra: str = Field("", max_length=_TEXT)

    def nbytes(self) -> int:
        return sum(len(v.encode()) for v in (self.id, self.response, self.prompt, self.reference, self.tests,
                                              self.entry_point, self.data_source, self.extra))


class Batch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[ItemIn] = Field(max_length=1 << 20)


class Counters:
    """What /metrics reports; plain counters, since one event loop updates them."""

    def __init__(self):
        self.started_s = time.time()
        self.requests = 0
        self.items: dict[str, int] = {"scored": 0, "unscored": 0, "error": 0}
        self.inflight = 0
        self.seconds_sum = 0.0

    def render(self, scorer) -> str:
        lines = [
            "# HELP rlslurm_reward_requests_total Batches received on /score.",
            "# TYPE rlslurm_reward_requests_total counter",
            f"rlslurm_reward_requests_total {self.requests}",
            "# HELP rlslurm_reward_items_total Items answered, by status.",
            "# TYPE rlslurm_reward_items_total counter",
            *(f'rlslurm_reward_items_total{{status="{k}"}} {v}' for k, v in self.items.items()),
            "# HELP rlslurm_reward_inflight Items being scored now.",
            "# TYPE rlslurm_reward_inflight gauge",
            f"rlslurm_reward_inflight {self.inflight}",
            "# HELP rlslurm_reward_score_seconds Seconds spent scoring items (sum and count).",
            "# TYPE rlslurm_reward_score_seconds summary",
            f"rlslurm_reward_score_seconds_sum {self.seconds_sum:.6f}",
            f"rlslurm_reward_score_seconds_count {sum(self.items.values())}",
            "# HELP rlslurm_reward_start_time_seconds Unix time this service process started.",
            "# TYPE rlslurm_reward_start_time_seconds gauge",
            f"rlslurm_reward_start_time_seconds {self.started_s:.3f}",
        ]
        if isinstance(scorer, JudgeScorer):
            lines += ["# HELP rlslurm_reward_judge_parse_failures_total Judge replies without a usable mark.",
                      "# TYPE rlslurm_reward_judge_parse_failures_total counter",
                      f"rlslurm_reward_judge_parse_failures_total {scorer.parse_failures}"]
        if isinstance(scorer, CodeScorer):
            lines += ["# HELP rlslurm_reward_sandbox_total Sandbox executions, by outcome.",
                      "# TYPE rlslurm_reward_sandbox_total counter",
                      *(f'rlslurm_reward_sandbox_total{{status="{k}"}} {v}' for k, v in scorer.outcomes.items())]
        pool = getattr(scorer, "pool", None) or getattr(scorer, "math", None)  # function / rule scorer
        if pool is not None:
            lines += ["# HELP rlslurm_reward_workers_replaced_total Worker processes killed (timeout) or found dead.",
                      "# TYPE rlslurm_reward_workers_replaced_total counter",
                      f"rlslurm_reward_workers_replaced_total {pool.replaced}"]
        return "\n".join(lines) + "\n"


class Beats:
    """The service's side of the phase guard: `score` while anything is in flight, `idle` otherwise."""

    def __init__(self, guard: PhaseGuard | None):
        self.guard = guard
        self.busy = 0

    def set_phase(self, name: str) -> None:
        hb = self.guard.heartbeat
        hb.update(progress=True, phase=name, phase_timeout_s=self.guard.config.timeout_for(name),
                  phase_started=hb.clock())

    def enter(self) -> None:
        self.busy += 1
        if self.guard is not None and self.busy == 1:
            self.set_phase("score")

    def leave(self) -> None:
        self.busy -= 1
        if self.guard is not None:
            self.guard.beat()
            if self.busy == 0:
                self.set_phase("idle")

    def item(self) -> None:
        if self.guard is not None:
            self.guard.beat()

    async def tick(self) -> None:
        """While idle, one beat per heartbeat interval: runs on the serving loop, so it stops when that wedges."""
        while True:
            await asyncio.sleep(self.guard.config.heartbeat_interval_s)
            if self.busy == 0:
                self.guard.beat()


def make_app(cfg: RewardConfig, token: str, guard: PhaseGuard | None = None) -> FastAPI:
    """The service for `cfg` behind the job's secret `token`; the scorer and its HTTP client live as long
    as the app."""
    state: dict = {}
    counters = Counters()
    beats = Beats(guard)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        http = ShardedHttp(cfg.concurrency, cfg.timeout_s)
        state["scorer"] = make_scorer(cfg, http=http)
        state["slots"] = asyncio.Semaphore(cfg.concurrency)
        warm = getattr(state["scorer"], "warm", None)
        if warm is not None:  # a reward function's workers import the user's file before /health answers
            try:
                await warm()
            except WorkerFailed as e:  # its items come back unscored with this reason; the log says it once
                log.error("%s", e)
        ticker = None
        if guard is not None:
            beats.set_phase("idle")
            ticker = asyncio.create_task(beats.tick())
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
            await http.aclose()
            await close_scorer(state["scorer"])  # its sandbox, its worker processes

    app = FastAPI(title="rlslurm reward service", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    # JSON per item: ~100 bytes of keys and quotes beside its text.
    body_bytes = cfg.max_items_per_request * (cfg.max_item_bytes + 1024) + 4096
    wire.protect(app, token, data_paths=("/score",), open_data=cfg.open_data_plane,
                 max_body_bytes=lambda path: body_bytes if path == "/score" else 4096)

    async def score_one(item: ItemIn) -> dict:
        if item.nbytes() > cfg.max_item_bytes:
            counters.items["unscored"] += 1
            return {"id": item.id, "score": None, "status": "unscored",
                    "reason": f"item is {item.nbytes()} bytes, over reward.max_item_bytes = {cfg.max_item_bytes}"}
        async with state["slots"]:
            counters.inflight += 1
            start = time.monotonic()
            try:
                # Bounded in time whatever the scorer: a judge that hangs, a rule on a pathological answer.
                verdict = await score_bounded(state["scorer"], Item(**item.model_dump()), cfg.timeout_s)
                out = {"id": item.id, "score": verdict.score, "status": verdict.status, "reason": verdict.reason}
            finally:
                counters.inflight -= 1
                counters.seconds_sum += time.monotonic() - start
                beats.item()
            counters.items[out["status"]] += 1
            return out

    @app.get("/health")
    async def health() -> dict:
        sandbox = getattr(state.get("scorer"), "sandbox", None)
        return {"status": "ok", "pid": os.getpid(), "scorer": cfg.scorer, "inflight": counters.inflight,
                "sandbox_mode": sandbox.mode if sandbox is not None else None}

    @app.post("/score")
    async def score(batch: Batch):
        if len(batch.items) > cfg.max_items_per_request:
            return JSONResponse(wire.error_body(
                f"{len(batch.items)} items are over reward.max_items_per_request = {cfg.max_items_per_request}",
                "invalid_request_error"), status_code=400)
        counters.requests += 1
        beats.enter()
        try:
            return {"results": list(await asyncio.gather(*(score_one(i) for i in batch.items)))}
        finally:
            beats.leave()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return counters.render(state.get("scorer"))

    return app


def load_reward_config(path: str | Path | None, **overrides) -> RewardConfig:
    """The `reward:` section of a job YAML (or the defaults), with command-line overrides applied."""
    data = {}
    if path is not None:
        data = dict((read_yaml(path) or {}).get("reward") or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    return load_mapping(RewardConfig, data, source=str(path or "<command line>"), key="reward")


def load_diag_config(path: str | Path | None) -> DiagConfig:
    """The `diag:` section of a job YAML (heartbeat interval, phase timeouts), or the defaults."""
    data = dict((read_yaml(path) or {}).get("diag") or {}) if path is not None else {}
    return load_mapping(DiagConfig, data, source=str(path or "<defaults>"), key="diag")


@click.command()
@click.option("--port", type=int, required=True, help="Port to listen on.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind: the one the job's peers use.")
@click.option("--secret-file", type=click.Path(dir_okay=False),
              help=f"The job's secret (<run>/secret); default: the file ${secret.ENV_VAR} names.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="Job YAML; its reward: section.")
@click.option("--scorer", type=click.Choice(["rule", "code", "function", "model", "judge"]),
              help="Overrides reward.scorer.")
@click.option("--endpoint", help="Overrides reward.endpoint.")
@click.option("--concurrency", type=int, help="Overrides reward.concurrency.")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory: heartbeats as role reward.")
def main(port: int, host: str, secret_file: str | None, config_path: str | None, scorer: str | None,
         endpoint: str | None, concurrency: int | None, run_dir: str | None) -> None:
    """Serve /health, /score and /metrics until killed."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward-service %(levelname)s %(message)s")
    lifetime.bind_to_parent()  # its own session (for its sandboxes' group), yet it ends with its supervisor
    # SLURM's signals to the step reach it all the same (measured: proctrack/linuxproc signals the step's process
    # tree): USR1, the drain's (`scancel -s USR1`, --signal=USR1@N), is the trainer's business, and its default
    # action ended the service at every such drain.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    token = secret.from_env_or(secret_file)
    cfg = load_reward_config(config_path, scorer=scorer, endpoint=endpoint, concurrency=concurrency)
    guard = None
    if run_dir is not None:
        from rlslurm.rundir import RunDir

        guard = PhaseGuard(RunDir(Path(run_dir)).create(), "reward", 0, load_diag_config(config_path))
    log.info("scorer %s, concurrency %d, listening on %s:%d", cfg.scorer, cfg.concurrency, host, port)
    # uvicorn shuts down on SIGTERM, then raises the signal again under the handler it found: with the
    # default one the process would die before the guard below writes its heartbeat `exited`.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        # The backlog must take a whole step's burst of connections from the client at once.
        uvicorn.run(make_app(cfg, token, guard), host=host, port=port, log_level="warning",
                    backlog=max(2048, cfg.concurrency * 4), http=connguard.protocol(token))
    finally:
        if guard is not None:
            guard.close()


if __name__ == "__main__":
    main()

"""The controller's reward client: each response is scored as soon as it arrives, not after the batch.

    async with RewardClient(cfg.reward, supervisor.url, run=run) as client:
        step = client.step(12)
        for sample in rollout_stream:                      # as the engine finishes each one
            step.submit(Item(id=sample.id, response=sample.text, reference=sample.answer))
        # or, for a whole batch at once: step.submit_many(items)
        async for outcome in step.as_completed():          # or: outcomes = await step.finish()
            ...
        summary = step.summary                             # degraded ratio of the step

Each response is its own POST /score (`submit`), or `reward.batch_size` share one (`submit_many`: the
RL controller hands over an engine's responses at once); at most `reward.concurrency` requests are in
flight, each bounded by `reward.timeout_s`. A timeout, a connection error or an HTTP 5xx retries the
request's items, an item answered `error` retries that item, `reward.retries` times after
`retry_backoff_s`, 2x, 4x ... (so retries land on a service the supervisor has just restarted). A response
still unscored then, or answered `unscored`, is degraded by `reward.degrade`: drop (no score, left out of
the step), neutral (`neutral_score`), fail (the step raises RewardServiceError in `finish()`). A step whose
degraded share passes `degraded_alert_ratio` writes a `reward_degraded` event.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import httpx

from rlslurm import secret
from rlslurm.errors import RewardServiceError
from rlslurm.events import REWARD_DEGRADED, emit
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import Item
from rlslurm.reward.scorers import ShardedHttp
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """The reward of one response; `score` is None only when it was dropped."""

    id: str
    score: float | None
    degraded: bool
    reason: str
    attempts: int


@dataclass(frozen=True)
class StepSummary:
    step: int
    total: int
    degraded: int
    dropped: int

    @property
    def degraded_ratio(self) -> float:
        return self.degraded / self.total if self.total else 0.0


class RewardClient:
    """Async client of one reward service URL; one `step()` per RL step. It sends the job's secret:
    `token`, else the one in the run directory (<run>/secret)."""

    def __init__(self, cfg: RewardConfig, url: str, run: RunDir | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, token: str | None = None):
        self.cfg = cfg
        self.url = url.rstrip("/")
        self.run = run
        self.sleep = sleep
        if token is None and run is not None:
            token = secret.read(run.secret)
        self.http = ShardedHttp(cfg.concurrency, cfg.timeout_s, headers=secret.bearer(token))
        self._slots = asyncio.Semaphore(cfg.concurrency)

    async def __aenter__(self) -> "RewardClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    def step(self, step: int) -> "StepScores":
        return StepScores(self, step)

    async def score(self, item: Item) -> Outcome:
        """Score one response: bounded, retried with backoff, then degraded by policy."""
        return (await self.score_batch([item]))[0]

    async def score_batch(self, items: list[Item]) -> list[Outcome]:
        """Score `items` in one request per attempt; the ones still unscored are retried, then degraded."""
        cfg = self.cfg
        done: dict[int, Outcome] = {}
        todo = list(range(len(items)))  # positions, since two items may share an id
        why: dict[int, str] = {}
        for attempt in range(cfg.retries + 1):
            if attempt:
                await self.sleep(cfg.retry_backoff_s * 2 ** (attempt - 1))
            async with self._slots:
                try:
                    # The pool wait counts too: a dead service must not hold a response past timeout_s.
                    results = await asyncio.wait_for(self._post([items[i] for i in todo]), cfg.timeout_s)
                    if len(results) != len(todo):
                        raise ValueError(f"{len(results)} results for {len(todo)} items")
                except (httpx.HTTPError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
                    why.update(dict.fromkeys(todo, f"attempt {attempt + 1}: {type(e).__name__} {e}".strip()))
                    continue
            retry = []
            for i, result in zip(todo, results):
                if result["status"] == "scored":
                    done[i] = Outcome(items[i].id, float(result["score"]), False, result.get("reason", ""),
                                      attempt + 1)
                elif result["status"] == "unscored":  # the scorer decided; asking again would not help
                    done[i] = self._degrade(items[i], f"unscored: {result.get('reason', '')}", attempt + 1)
                else:
                    why[i] = f"attempt {attempt + 1}: {result.get('reason', 'error')}"
                    retry.append(i)
            todo = retry
            if not todo:
                break
        for i in todo:
            done[i] = self._degrade(items[i], f"gave up after {cfg.retries + 1} attempts; last {why[i]}",
                                    cfg.retries + 1)
        return [done[i] for i in range(len(items))]

    async def _post(self, items: list[Item]) -> list[dict]:
        reply = await self.http.post(self.url + "/score", json={"items": [item.__dict__ for item in items]})
        if reply.status_code in (401, 403):  # a retry would be refused alike: fail the step, loudly
            raise RewardServiceError(f"reward service {self.url} refused this client's secret: HTTP "
                                     f"{reply.status_code} {reply.text[:300]}")
        reply.raise_for_status()
        return reply.json()["results"]

    def _degrade(self, item: Item, why: str, attempts: int) -> Outcome:
        score = self.cfg.neutral_score if self.cfg.degrade == "neutral" else None
        return Outcome(item.id, score, True, f"degraded ({self.cfg.degrade}): {why}", attempts)


class StepScores:
    """The responses of one step: submit as they arrive, then iterate or finish."""

    def __init__(self, client: RewardClient, step: int):
        self.client = client
        self.step = step
        self.tasks: list[asyncio.Task] = []
        self.summary: StepSummary | None = None
        self.settled = 0
        """Responses with an outcome so far (updated on the event loop; a plain int any thread may read)."""

    def _track(self, task: asyncio.Task, count: int) -> asyncio.Task:
        task.add_done_callback(lambda _: setattr(self, "settled", self.settled + count))
        self.tasks.append(task)
        return task

    def submit(self, item: Item) -> asyncio.Task:
        """Start scoring `item` now, in a request of its own; the task's result is its Outcome."""
        return self._track(asyncio.ensure_future(self.client.score(item)), 1)

    def submit_many(self, items: list[Item]) -> list[asyncio.Task]:
        """Start scoring `items` now, `reward.batch_size` per request; each task's result is a list of Outcomes."""
        size = self.client.cfg.batch_size
        return [self._track(asyncio.ensure_future(self.client.score_batch(items[i:i + size])), len(items[i:i + size]))
                for i in range(0, len(items), size)]

    async def as_completed(self) -> AsyncIterator[Outcome]:
        """Outcomes of every submitted response in the order they finish; then `finish()` runs."""
        for next_done in asyncio.as_completed(self.tasks):
            for outcome in _flat([await next_done]):
                yield outcome
        await self.finish()

    async def finish(self) -> list[Outcome]:
        """Wait for all; write the step's summary (and event); raise when degrade = fail and any degraded."""
        outcomes = _flat(await asyncio.gather(*self.tasks))
        cfg = self.client.cfg
        degraded = [o for o in outcomes if o.degraded]
        self.summary = StepSummary(self.step, len(outcomes), len(degraded),
                                   sum(o.score is None for o in outcomes))
        ratio = self.summary.degraded_ratio
        if degraded and ratio > cfg.degraded_alert_ratio:
            log.warning("step %d: %d of %d responses degraded (%.1f%% > %.1f%%)", self.step, len(degraded),
                        len(outcomes), 100 * ratio, 100 * cfg.degraded_alert_ratio)
            if self.client.run is not None:
                emit(self.client.run, REWARD_DEGRADED, step=self.step, degraded=len(degraded),
                     total=len(outcomes), ratio=round(ratio, 4), alert_ratio=cfg.degraded_alert_ratio,
                     policy=cfg.degrade, first_reason=degraded[0].reason[:300])
        if degraded and cfg.degrade == "fail":
            raise RewardServiceError(
                f"step {self.step}: {len(degraded)} of {len(outcomes)} responses could not be scored and "
                f"reward.degrade = 'fail'; first: {degraded[0].reason}")
        return outcomes


def _flat(results: list) -> list[Outcome]:
    """Task results in order, a batch's list of Outcomes spliced in where it stands."""
    return [o for r in results for o in (r if isinstance(r, list) else [r])]

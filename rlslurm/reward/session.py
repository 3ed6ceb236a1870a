"""The RL controller's reward service: started beside it (`reward.service: local`) or found where the reward
het component announced it (`component`), and scored through the streaming client.

    session = RewardSession.open(job.reward, run, diag=job.diag)   # local: blocks until /health answers
    scoring = session.begin(step)
    scoring.submit(items)                       # as each engine's responses arrive; scored meanwhile
    outcomes, stats = scoring.finish(guard)     # stats: reward_degraded, reward_degraded_ratio, ...
    session.close()

The controller is synchronous and the client (client.py) is asyncio: the session runs one event loop in
a thread of its own (`reward-client`), so the client's connection pools live across steps and responses
are scored while the controller still waits for the next engine. Lifecycle: `open()` starts the loop and,
for `local`, the supervised service (supervisor.py); `close()` ends the client, the loop and the service.

Restarts are counted from the supervisor's `reward_service_restarted` events in <run>/events.jsonl, read
on from where the previous step stopped: the same whether the supervisor runs in this process or on the
reward component's node. A `reward_service_down` there fails the step (RewardServiceError): past
`reward.max_restarts` every later response would only be degraded.

On SLURM the component writes <run>/endpoints/reward.json {url, node, pid, job_id, restart_count}
(`announce`); the controller takes the file of this start of the job only (`wait_for_url`), since a
requeued job finds the previous start's file there until the new component replaces it. The URL taken
is recorded as a `reward_endpoint` event (job id, restart count, seconds waited).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

from rlslurm import events, lifecycle
from rlslurm.diag.config import DiagConfig
from rlslurm.errors import RewardServiceError
from rlslurm.reward.client import Outcome, RewardClient, StepScores
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import Item
from rlslurm.reward.supervisor import RewardSupervisor
from rlslurm.rundir import JsonlTail, RunDir

log = logging.getLogger(__name__)
ENDPOINT_FILE = "reward.json"


def announce(run: RunDir, url: str, node: str) -> Path:
    """Write <run>/endpoints/reward.json for the controller (atomically: it polls the file)."""
    folder = run.path / "endpoints"
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{ENDPOINT_FILE}.tmp"
    tmp.write_text(json.dumps({"url": url, "node": node, "pid": os.getpid(), "job_id": lifecycle.leader_job_id(),
                               "restart_count": lifecycle.restart_count()}))
    return tmp.replace(folder / ENDPOINT_FILE)


def wait_for_url(run: RunDir, timeout_s: float, *, job_id: str | None, restart_count: int,
                 poll_s: float = 0.5) -> str:
    """The URL the reward component of this start of the job announced; polled, bounded by `timeout_s`."""
    path = run.path / "endpoints" / ENDPOINT_FILE
    deadline = time.monotonic() + timeout_s
    while True:
        record = {}
        if path.is_file():
            record = json.loads(path.read_text())
            if (record.get("job_id"), record.get("restart_count")) == (job_id, restart_count):
                return record["url"]
        if time.monotonic() > deadline:
            seen = f"only a stale one ({record})" if record else "none"
            raise RewardServiceError(
                f"the reward component of job {job_id} restart {restart_count} announced no URL in {path} within "
                f"{timeout_s:g} s (reward.start_timeout_s), {seen}; see {run.logs}/reward-*.log")
        log.info("waiting for the reward service's endpoint in %s", path)
        time.sleep(poll_s)


class ServiceEvents:
    """The supervisor's events appended to <run>/events.jsonl since the previous read (complete lines only)."""

    def __init__(self, run: RunDir):
        self.tail = JsonlTail(run.events, from_end=True)

    def read(self) -> list[dict]:
        return events.select(self.tail.read(), *events.REWARD_SERVICE)


class RewardSession:
    """One reward service URL, its client on a private event loop, and (local) its supervisor."""

    def __init__(self, cfg: RewardConfig, run: RunDir, url: str, supervisor: RewardSupervisor | None):
        self.cfg, self.run, self.url, self.supervisor = cfg, run, url, supervisor
        self.events = ServiceEvents(run)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="reward-client", daemon=True)
        self._thread.start()

        async def make_client() -> RewardClient:
            return RewardClient(cfg, url, run=run)

        self.client = self._call(make_client())

    @classmethod
    def open(cls, cfg: RewardConfig, run: RunDir, *, diag: DiagConfig | None = None,
             component: bool = False, env: Mapping[str, str] | None = None) -> "RewardSession":
        """`component`: the URL the reward het component announces; else a supervised service here, started
        with `env` added to its environment (the supervisor's)."""
        if component:
            job_id, restarts, started = lifecycle.leader_job_id(), lifecycle.restart_count(), time.monotonic()
            url = wait_for_url(run, cfg.start_timeout_s, job_id=job_id, restart_count=restarts)
            log.info("reward service of the reward component at %s", url)
            events.emit(run, events.REWARD_ENDPOINT, role="controller", url=url, job_id=job_id, restart_count=restarts,
                        waited_s=round(time.monotonic() - started, 3))
            return cls(cfg, run, url, None)
        supervisor = RewardSupervisor(cfg, run=run, diag=diag, env=env)
        supervisor.start()
        log.info("reward service (pid %d) at %s", supervisor.proc.pid, supervisor.url)
        return cls(cfg, run, supervisor.url, supervisor)

    def _call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def begin(self, step: int) -> "StepScoring":
        return StepScoring(self, step)

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._call(self.client.__aexit__(None, None, None), timeout_s=10)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)
                self.loop.close()
        if self.supervisor is not None:
            self.supervisor.stop()


class StepScoring:
    """One step's responses: `submit` them as they arrive, `finish` once the rollout is done."""

    def __init__(self, session: RewardSession, step: int):
        self.session = session
        self.scores = StepScores(session.client, step)
        self.submitted = 0

    def submit(self, items: list[Item], on_outcomes: Callable[[list[Outcome]], None] | None = None) -> None:
        """Hand `items` to the client's loop; they are scored from now on (`reward.batch_size` per request).
        `on_outcomes(outcomes)` runs on the client's loop thread as each request settles (the controller
        computes a prompt's advantages as soon as its group is scored); `finish` still returns them all."""
        self.submitted += len(items)
        items = list(items)

        def start() -> None:
            for task in self.scores.submit_many(items):
                if on_outcomes is not None:
                    task.add_done_callback(lambda t: t.cancelled() or t.exception() or on_outcomes(t.result()))

        self.session.loop.call_soon_threadsafe(start)

    def bound_s(self) -> float:
        """Longest the client may take for what was submitted: every request waits for a slot, then each
        attempt is bounded by timeout_s and followed by a backoff."""
        cfg = self.session.cfg
        waves = math.ceil(math.ceil(self.submitted / cfg.batch_size) / cfg.concurrency)
        backoff = sum(cfg.retry_backoff_s * 2 ** i for i in range(cfg.retries))
        return waves * (cfg.retries + 1) * cfg.timeout_s + backoff + 10.0

    def finish(self, guard=None) -> tuple[list[Outcome], dict]:
        """Outcomes in submission order and the step's reward stats; raises RewardServiceError when the
        policy is `fail` and a response could not be scored, or when the supervisor gave up."""
        session = self.session
        # Scheduled after every submit (call_soon_threadsafe keeps order), so it gathers all of them.
        future = asyncio.run_coroutine_threadsafe(self.scores.finish(), session.loop)
        bound_s, started, seen = self.bound_s(), time.monotonic(), 0
        while True:
            try:
                outcomes = future.result(timeout=0.5)
                break
            except concurrent.futures.TimeoutError:
                pass
            if guard is not None and self.scores.settled > seen:  # progress: more responses scored
                seen = self.scores.settled
                guard.beat()
            if time.monotonic() - started > bound_s:
                future.cancel()
                raise RewardServiceError(
                    f"step {self.scores.step}: {self.scores.settled} of {self.submitted} responses scored after "
                    f"{bound_s:.0f} s, past what reward.timeout_s, retries and concurrency allow; "
                    f"service {session.url}")
        said = session.events.read()
        down = events.select(said, events.REWARD_SERVICE_DOWN)
        if down:
            raise RewardServiceError(
                f"step {self.scores.step}: the reward supervisor on {down[0].get('host')} gave up after "
                f"{down[0].get('attempts')} restarts (reward.max_restarts = {down[0].get('max_restarts')}): "
                f"{down[0].get('reason')}; see {down[0].get('log')}")
        summary = self.scores.summary
        return outcomes, {"reward_degraded": summary.degraded, "reward_degraded_ratio": summary.degraded_ratio,
                          "reward_dropped": summary.dropped,
                          "reward_restarts": len(events.select(said, events.REWARD_SERVICE_RESTARTED))}

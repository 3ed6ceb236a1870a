"""Admission and batching in front of one engine: the admission gate and the request batcher.

AdmissionGate lifecycle: serving -> drain() -> draining (new requests refused) -> drained (in-flight
reached zero, bounded by timeout_s) -> resume() -> serving. The weight-sync protocol drives it.

Batcher lifecycle: start() spawns one thread that blocks on the request queue; submit() returns a
Future; stop() wakes the thread with a sentinel and joins it. Requests queued while a batch runs are
merged into the next `generate` call when their sampling settings match (a seeded request runs
alone, so its seed means what it says). One thread runs all generations, so a batch never straddles
a weight update and every sample in it carries the same version.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from rlslurm.rollout.engine import Engine, SamplingParams

log = logging.getLogger(__name__)


class AdmissionGate:
    """Counts requests in flight and refuses new ones while draining or drained.

    Not the job's drain gate (diag/drain_gate.py DrainGate, "stop taking work and leave"): this one
    closes one engine's door for the length of a weight update.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self.state = "serving"
        self.in_flight = 0

    def enter(self) -> bool:
        with self._cond:
            if self.state != "serving":
                return False
            self.in_flight += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait up to timeout_s for in-flight requests. False = still some left."""
        with self._cond:
            if self.state == "serving":
                self.state = "draining"
                log.info("draining: waiting up to %.1f s for %d in-flight requests", timeout_s, self.in_flight)
            if not self._cond.wait_for(lambda: self.in_flight == 0, timeout_s):
                log.warning("drain timed out after %.1f s with %d in flight", timeout_s, self.in_flight)
                return False
            self.state = "drained"
            return True

    def resume(self) -> None:
        with self._cond:
            self.state = "serving"


@dataclass
class _Job:
    prompts: list
    params: SamplingParams
    future: Future


class Batcher:
    """One generation thread; concurrent callers with equal sampling settings share a batch."""

    def __init__(self, engine: Engine, *, max_batch_prompts: int = 256):
        self.engine = engine
        self.max_batch_prompts = max_batch_prompts
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.batches = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        if self._thread:
            self._thread.join(timeout_s)

    def submit(self, prompts: list, params: SamplingParams) -> Future:
        job = _Job(prompts, params, Future())
        self._queue.put(job)
        return job.future

    def _run(self) -> None:
        pending: deque[_Job] = deque()
        while True:
            try:
                item = self._queue.get() if not pending else self._queue.get_nowait()
            except queue.Empty:
                item = ...
            if item is None:
                break
            if item is not ...:
                pending.append(item)
                continue  # keep collecting whatever else is already queued
            self._execute(self._take(pending))
        for job in pending:
            job.future.set_exception(RuntimeError("engine server stopped"))

    def _take(self, pending: deque[_Job]) -> list[_Job]:
        first = pending.popleft()
        key = first.params.batch_key()
        batch, rows = [first], len(first.prompts) * first.params.n
        if key is None:
            return batch
        for job in list(pending):
            size = len(job.prompts) * job.params.n
            if job.params.batch_key() == key and rows + size <= self.max_batch_prompts:
                pending.remove(job)
                batch.append(job)
                rows += size
        return batch

    def _execute(self, batch: list[_Job]) -> None:
        self.batches += 1
        try:
            if len(batch) == 1:
                results = [self.engine.generate(batch[0].prompts, batch[0].params)]
            else:
                results = self._generate_merged(batch)
        except Exception as e:  # the callers get the error; the thread keeps serving
            log.exception("generation failed for a batch of %d requests", len(batch))
            for job in batch:
                job.future.set_exception(e)
            return
        for job, result in zip(batch, results):
            job.future.set_result(result)

    def _generate_merged(self, batch: list[_Job]) -> list[list]:
        # Expand each request's prompts n times and sample once per row, then regroup per request.
        rows = [p for job in batch for p in job.prompts for _ in range(job.params.n)]
        p0 = batch[0].params
        flat = self.engine.generate(rows, SamplingParams(n=1, temperature=p0.temperature,
                                                         max_new_tokens=p0.max_new_tokens))
        out, i = [], 0
        for job in batch:
            per_job = []
            for p in range(len(job.prompts)):
                samples = []
                for s in range(job.params.n):
                    c = flat[i][0]
                    c.prompt_index, c.sample_index = p, s
                    samples.append(c)
                    i += 1
                per_job.append(samples)
            out.append(per_job)
        return out

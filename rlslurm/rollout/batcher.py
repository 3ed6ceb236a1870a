"""Admission and batching in front of one engine: the admission gate, the request limits, and the batcher.

AdmissionGate lifecycle: serving -> drain() -> draining (new requests refused) -> drained (in-flight
reached zero, bounded by timeout_s) -> resume() -> serving. The weight-sync protocol drives it.

Limits: what one request may ask for (n, max_tokens, prompts, prompt tokens against the model's
context, rows of one generate call, token ids inside the vocabulary); `check` names the limit broken, and
`check_text` refuses a text prompt by its length before it is tokenized.

Batcher lifecycle: start() spawns one thread that waits for jobs; submit() queues one and returns it
(its `future` has the result); stop() aborts what is queued or running and joins the thread. Jobs
queued while a batch runs are merged into the next `generate` call when their sampling settings match
(a seeded request runs alone, so its seed means what it says). One thread runs all generations, so a
batch never straddles a weight update and every sample in it carries the same version.

Every job has a deadline. `cancel(job, ...)` drops it: a queued job is removed and never runs; a
running one is stopped at the next decoding step (the engine asks the batch's Control at every step).
Past its deadline a job is dropped the same way. `stalled()` says when work is pending and the
generation loop has not stepped for a while: the server's /health turns that into a 503.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from rlslurm.rollout.engine import Engine, SamplingParams
from rlslurm.textbound import too_long

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
                # Every weight sync drains: a line per step only where requests were in flight to wait for.
                log.log(logging.INFO if self.in_flight else logging.DEBUG,
                        "draining: waiting up to %.1f s for %d in-flight requests", timeout_s, self.in_flight)
            if not self._cond.wait_for(lambda: self.in_flight == 0, timeout_s):
                log.warning("drain timed out after %.1f s with %d in flight", timeout_s, self.in_flight)
                return False
            self.state = "drained"
            return True

    def resume(self) -> None:
        with self._cond:
            self.state = "serving"


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one request may ask of the engine; each broken limit is a 400 that names it (`check`)."""

    max_n: int = 64
    """Samples per prompt (`n`); the job's rollout.max_n."""
    max_tokens: int = 1024
    """Tokens generated per sample (`max_tokens`); the job's rollout.max_new_tokens."""
    max_prompts: int = 1024
    """Prompts per request; the job's rollout.max_prompts_per_request."""
    max_prompt_tokens: int | None = None
    """Tokens of one prompt; None = the model's context less max_tokens. The job's rollout.max_prompt_tokens."""
    max_batch_rows: int = 4096
    """Prompts x n of one request, and of one merged generate call; the job's rollout.max_batch_rows."""
    context_tokens: int | None = None
    """Prompt + generated tokens of one sequence: the served model's max_position_embeddings."""
    vocab_size: int | None = None
    """Token ids are in [0, vocab_size)."""

    def prompt_tokens(self, max_tokens: int) -> int | None:
        """Tokens one prompt may take with `max_tokens` to generate: max_prompt_tokens and what the context leaves."""
        room = [t for t in (self.max_prompt_tokens,
                            self.context_tokens - max_tokens if self.context_tokens is not None else None)
                if t is not None]
        return max(0, min(room)) if room else None

    def check_text(self, prompts: Sequence, max_tokens: int, per_token: int) -> str | None:
        """Why a text prompt is refused by its length alone, before the tokenizer sees it (rlslurm/textbound.py:
        more bytes than the prompt's tokens can hold at the vocabulary's longest token, `per_token` bytes), or None."""
        tokens = self.prompt_tokens(max_tokens)
        if tokens is None:
            return None
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                problem = too_long(prompt, tokens=tokens, per_token=per_token, what=f"prompt {i}")
                if problem is not None:
                    return problem + " (rollout.max_prompt_tokens, the model's context less max_tokens)"
        return None

    def check(self, prompts: Sequence[Sequence[int]], n: int, max_tokens: int) -> str | None:
        """Why this request is refused (the limit and the values), or None."""
        if not prompts:
            return "need at least one prompt"
        if n < 1 or max_tokens < 1:
            return f"n = {n} and max_tokens = {max_tokens} must both be >= 1"
        if n > self.max_n:
            return f"n = {n} is over the engine's limit max_n = {self.max_n} (rollout.max_n)"
        if max_tokens > self.max_tokens:
            return f"max_tokens = {max_tokens} is over the engine's limit {self.max_tokens} (rollout.max_new_tokens)"
        if len(prompts) > self.max_prompts:
            return (f"{len(prompts)} prompts are over the engine's limit max_prompts_per_request = "
                    f"{self.max_prompts} (rollout.max_prompts_per_request)")
        if len(prompts) * n > self.max_batch_rows:
            return (f"{len(prompts)} prompts x n = {n} = {len(prompts) * n} sequences are over the engine's "
                    f"limit max_batch_rows = {self.max_batch_rows} (rollout.max_batch_rows)")
        for i, ids in enumerate(prompts):
            if not ids:
                return f"prompt {i} encodes to zero tokens"
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                return (f"prompt {i} has {len(ids)} tokens, over the engine's limit max_prompt_tokens = "
                        f"{self.max_prompt_tokens} (rollout.max_prompt_tokens)")
            if self.context_tokens is not None and len(ids) + max_tokens > self.context_tokens:
                return (f"prompt {i} has {len(ids)} tokens + max_tokens {max_tokens} = {len(ids) + max_tokens}, "
                        f"over the model's context of {self.context_tokens} tokens (max_position_embeddings)")
            if self.vocab_size is not None:
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    return f"prompt {i}: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        return None


class Dropped(Exception):
    """A job's work was dropped before it finished; `status` is the HTTP answer its caller gets."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Job:
    prompts: list
    params: SamplingParams
    deadline: float
    """On the batcher's clock: past it the job is dropped (504), queued or running."""
    future: Future = field(default_factory=Future)
    state: str = "queued"
    """queued -> running -> done (a job dropped while queued goes straight to done)."""
    stop: Dropped | None = None
    """Set when the job must stop: a running job ends at the next decoding step with this error."""

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n


class Batcher:
    """One generation thread; concurrent callers with equal sampling settings share a batch."""

    def __init__(self, engine: Engine, *, max_batch_rows: int = 4096, clock: Callable[[], float] = time.monotonic,
                 debug_stall_s: float = 0.0):
        self.engine = engine
        self.max_batch_rows = max_batch_rows
        self.clock = clock
        self.debug_stall_s = debug_stall_s  # tests only: each generate call first waits this long, no progress
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._running: list[Job] = []
        self._stopping: Dropped | None = None
        self._wake = threading.Event()  # ends a debug stall at once when the server stops
        self._thread: threading.Thread | None = None
        self.batches = 0
        self.steps = 0  # decoding steps of all batches: what /health shows moving
        self.dropped: dict[str, int] = {"deadline": 0, "disconnected": 0, "stopped": 0}
        self.last_progress = clock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def abort_all(self, message: str = "engine server is stopping") -> None:
        """Drop every queued and running job (503) and take no more: the first thing a SIGTERM does."""
        with self._cond:
            log.info("%s: dropping %d queued and %d running requests", message, len(self._pending), len(self._running))
            self._stopping = Dropped(message, 503)
            for job in list(self._pending):
                self._drop_queued(job, self._stopping, "stopped")
            for job in self._running:
                job.stop = job.stop or self._stopping
            self._cond.notify_all()
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.abort_all()
        if self._thread:
            self._thread.join(timeout_s)

    def submit(self, prompts: list, params: SamplingParams, timeout_s: float) -> Job:
        job = Job(prompts, params, deadline=self.clock() + timeout_s)
        with self._cond:
            if self._stopping is not None:
                raise Dropped(str(self._stopping), 503)
            if not self._pending and not self._running:
                self.last_progress = self.clock()  # idle time is no stall
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def cancel(self, job: Job, error: Dropped, why: str) -> None:
        """Drop `job` (why: deadline | disconnected): removed if queued, stopped at the next step if running."""
        with self._cond:
            if job.state == "queued":
                self._drop_queued(job, error, why)
            elif job.state == "running" and job.stop is None:
                job.stop = error
                self.dropped[why] += 1

    def _drop_queued(self, job: Job, error: Dropped, why: str) -> None:
        self._pending.remove(job)
        job.state = "done"
        self.dropped[why] += 1
        job.future.set_exception(error)

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return len(self._pending) + len(self._running)

    def stalled(self, timeout_s: float) -> str | None:
        """Why the generation loop counts as wedged (work pending, no step for timeout_s), or None."""
        with self._cond:
            waiting = len(self._pending) + len(self._running)
            idle_s = self.clock() - self.last_progress
        if waiting and idle_s > timeout_s:
            return (f"generation loop made no progress for {idle_s:.1f} s (rollout.stall_timeout_s = "
                    f"{timeout_s:g}) with {waiting} requests pending")
        return None

    # -- the generation thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stopping is not None)
                if self._stopping is not None:
                    return
                batch = self._take()
                for job in batch:
                    job.state = "running"
                self._running = batch
            if batch:
                self._execute(batch)
            with self._cond:
                self._running = []
                self.last_progress = self.clock()

    def _take(self) -> list[Job]:
        """The next batch (under the lock): the first live job, and the queued ones it can share a call with."""
        now = self.clock()
        for job in [j for j in self._pending if now > j.deadline]:
            self._drop_queued(job, Dropped("request waited past its deadline (rollout.request_timeout_s)", 504),
                              "deadline")
        if not self._pending:
            return []
        first = self._pending.popleft()
        key = first.params.batch_key()
        batch, rows = [first], first.rows
        if key is None:
            return batch
        for job in list(self._pending):
            if job.params.batch_key() == key and rows + job.rows <= self.max_batch_rows:
                self._pending.remove(job)
                batch.append(job)
                rows += job.rows
        return batch

    def _execute(self, batch: list[Job]) -> None:
        self.batches += 1
        try:
            if self.debug_stall_s:
                self._wake.wait(self.debug_stall_s)
            if len(batch) == 1:
                results = [self.engine.generate(batch[0].prompts, batch[0].params,
                                                _Control(self, [batch[0]] * len(batch[0].prompts)))]
            else:
                results = self._generate_merged(batch)
        except Exception as e:  # the callers get the error; the thread keeps serving
            log.exception("generation failed for a batch of %d requests", len(batch))
            results = [e] * len(batch)
        with self._cond:
            for job, result in zip(batch, results):
                job.state = "done"
                if job.stop is not None:
                    job.future.set_exception(job.stop)
                elif isinstance(result, Exception):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _generate_merged(self, batch: list[Job]) -> list[list]:
        # Expand each request's prompts n times and sample once per row, then regroup per request.
        rows = [p for job in batch for p in job.prompts for _ in range(job.params.n)]
        owners = [job for job in batch for _ in job.prompts for _ in range(job.params.n)]
        p0 = batch[0].params
        flat = self.engine.generate(rows, SamplingParams(n=1, temperature=p0.temperature,
                                                         max_new_tokens=p0.max_new_tokens), _Control(self, owners))
        out, i = [], 0
        for job in batch:
            per_job = []
            for p in range(len(job.prompts)):
                samples = []
                for s in range(job.params.n):
                    if flat[i]:  # empty: stopped (the job gets its error, not this)
                        c = flat[i][0]
                        c.prompt_index, c.sample_index = p, s
                        samples.append(c)
                    i += 1
                per_job.append(samples)
            out.append(per_job)
        return out


class _Control:
    """The engine's view of one running batch: every decoding step is progress; a prompt whose job must
    stop (cancelled, past its deadline, server stopping) is stopped."""

    def __init__(self, batcher: Batcher, owners: list[Job]):
        self.batcher, self.owners = batcher, owners
        self.jobs = list(dict.fromkeys(owners))

    def step(self) -> list[bool] | None:
        b = self.batcher
        now = b.clock()
        b.last_progress = now
        b.steps += 1
        late = [j for j in self.jobs if j.stop is None and now > j.deadline]
        if late:
            error = Dropped("request ran past its deadline while generating (rollout.request_timeout_s)", 504)
            for job in late:
                b.cancel(job, error, "deadline")
        if not any(j.stop is not None for j in self.jobs):
            return None
        return [j.stop is not None for j in self.owners]

"""The experience pipeline: each RL step's rollout -> reward -> advantages, made up to `rl.max_staleness`
(k) policy versions ahead of the trainer, in a thread of its own, while the trainer trains.

    pipeline = ExperiencePipeline(rollout, finish, max_staleness=k, first_step=s, last_step=n)
    pipeline.start()
    for step in range(s, n):
        exp = pipeline.take(step, guard)       # made while earlier steps trained (k >= 1), or now (k = 0)
        ...train...
        pipeline.before_sync(step + 1)         # the rollouts that must still see the old weights are done
        ...WeightSync.sync(...)...
        pipeline.synced(step + 1)              # rollouts waiting for the new weights may start
        rl_state["experience_buffer"] = pipeline.buffered(step + 1)   # what a checkpoint here must keep
    pipeline.close()

The schedule (policy versions count steps: the trainer trains step m at version m, relative to a run's
start). Step m is rolled out on the weights of version m - k (version 0 for the first k steps): the
producer starts step m's rollout once the engines serve version >= m - k, and the sync to version v waits
until every step m <= v - 1 + k is rolled out, so no rollout ever straddles a sync and no step sees newer
weights than its schedule. Hence:
- staleness (trainer version at training - sample version) is exactly min(m, k) for step m, never > k;
  `stamp_staleness` checks it per sample and raises StalenessError past k (that is a bug, not a setting);
- the trajectory is a function of the seeds alone, as in the synchronous job: the same weights sample the
  same prompts with the same engine seeds whatever the threads' timing;
- k = 0 is the synchronous job: nothing runs ahead, and by default no thread at all (`take` runs the step
  inline, under the caller's phase guard, exactly as before the pipeline existed).

With one thread the rollout of step m + 1 waits for the reward of step m; the reward streams while the
rollout runs (rlslurm/rl/experience.py), so only its tail is serial. At most k + 1 steps of experience are
buffered (the step being trained and k ahead).

Correctness guard for stale samples: they were sampled by an older policy, so the loss (rlslurm/rl/policy.py
Policy.update) uses the PPO importance ratio pi_theta / pi_behaviour with the engine's own logprobs as
pi_behaviour, clipped to [1 - rl.clip_eps, 1 + rl.clip_eps]: a token the policy already moved past the
clip since it was sampled gets no further push. Fresh samples (staleness 0) keep the trainer's logprobs as
the old policy: ratio exactly 1, so k = 0 trains bit for bit as before. See docs/rl-overlap.md.

Checkpoints and resume: the experience made ahead of a step boundary b (steps b .. b + k - 1, rolled out
on weights no checkpoint keeps) is saved in the RL state (`buffered(b)`, plain JSON); a resumed run puts it
back (`ExperiencePipeline(..., buffered=...)`) and produces from step b + k on, on the restored weights of
version b, as the uninterrupted run did: the same trajectory. A step missing there (a drain that cut a
reward short) is made again on version b: fresher than its schedule, still within k, but then the
trajectory differs from the uninterrupted run's from that step on.

Threads: the producer (`rl-experience`) never touches the phase guard (beats from a background thread
would hide a wedged main thread); it counts progress in a ProducerGuard, and the main thread, waiting in
`take`/`before_sync`/`buffered`, beats its own guard each time that count moves. Its errors are raised in
the main thread by the call that waits for the step that failed. Lifecycle: `start()` once, `close()`
once (it stops the producer between calls; an HTTP call in flight ends by its own timeout, or when
the engines it talks to stop: `stop()` first, then the engines, then `close()`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Generic, Iterator, TypeVar

from rlslurm.errors import RlslurmError, StalenessError
from rlslurm.rl.experience import Experience

log = logging.getLogger(__name__)

THREADED_ENV = "RLSLURM_RL_THREADED_PIPELINE"
"""Set to 1: run the producer thread even with max_staleness 0 (tests: k = 0 through the thread must
reproduce the inline, synchronous trajectory)."""

P = TypeVar("P")


class ProducerGuard:
    """The phase guard's stand-in in the producer thread: phases are not written (the main thread's guard
    owns the heartbeat), beats only count progress for the main thread to see."""

    def __init__(self):
        self.beats = 0

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator["ProducerGuard"]:
        yield self
        self.beats += 1

    def beat(self, step: int | None = None) -> None:
        self.beats += 1


def stamp_staleness(exp: Experience, version: int, max_staleness: int, step: int) -> dict:
    """Set every sample's staleness (trainer `version` - the sample's version) and return the step's
    staleness_mean / staleness_max over all its responses (those of dropped groups too); raises
    StalenessError for a response older than `max_staleness` versions or newer than the trainer."""
    counts = exp.response_versions or {}
    if not counts:
        for s in exp.samples:
            counts[s.version] = counts.get(s.version, 0) + 1
    lags = {version - v: n for v, n in counts.items()}
    worst, newest = max(lags, default=0), min(lags, default=0)
    if worst > max_staleness or newest < 0:
        raise StalenessError(
            f"step {step}: trainer at policy version {version} got responses of versions {sorted(counts)} "
            f"(staleness {worst}, rl.max_staleness = {max_staleness}): the experience pipeline broke its "
            "schedule; a stale sample must never reach the loss past the bound")
    for s in exp.samples:
        s.staleness = version - s.version
    total = sum(counts.values())
    return {"staleness_mean": sum(lag * n for lag, n in lags.items()) / total if total else 0.0,
            "staleness_max": worst}


class ExperiencePipeline(Generic[P]):
    """Experience for steps first_step .. last_step - 1, made k = max_staleness steps ahead (see the module
    docstring for the schedule). `rollout(step, guard) -> P` uses the engines; `finish(P, guard) ->
    Experience` only waits for rewards and builds samples, and may overlap a weight sync."""

    def __init__(self, rollout: Callable[[int, object], P], finish: Callable[[P, object], Experience], *,
                 max_staleness: int, first_step: int, last_step: int,
                 buffered: dict[int, Experience] | None = None, threaded: bool | None = None,
                 poll_s: float = 0.5, log_every_s: float = 30.0):
        if max_staleness < 0 or (max_staleness > 0 and threaded is False):
            raise RlslurmError(f"rl.max_staleness = {max_staleness} needs the producer thread (>= 0; > 0 runs ahead)")
        self.k, self.first_step, self.last_step = max_staleness, first_step, last_step
        self._rollout, self._finish = rollout, finish
        self.threaded = max_staleness > 0 or bool(threaded)
        self.poll_s, self.log_every_s = poll_s, log_every_s
        self._cond = threading.Condition()
        self._ready: dict[int, Experience] = {}
        # A checkpoint's buffer: only the unbroken run of steps from first_step on, at most k of them
        # (what the schedule could have made ahead); the rest is made again.
        m = first_step
        while buffered and m in buffered and m < first_step + self.k and m < last_step:
            self._ready[m] = buffered[m]
            m += 1
        self._next = m                 # first step the producer makes
        self._rolled_through = m - 1   # last step whose rollout is done
        self._served = first_step      # step boundary whose weights the engines serve
        self._error: tuple[int, BaseException] | None = None
        self._stalled: int | None = None  # step whose rollout waits for the trainer's next sync (no engine left)
        self._closed = False
        self._producing: tuple[int, str] | None = None  # (step, what) the producer is at, for logs
        self.guard = ProducerGuard()
        self._thread: threading.Thread | None = None

    @property
    def restored(self) -> list[int]:
        """Steps taken from a checkpoint's buffer (made before a requeue)."""
        return list(range(self.first_step, self._next))

    def start(self) -> "ExperiencePipeline":
        if self.threaded and self._thread is None and self._next < self.last_step:
            self._thread = threading.Thread(target=self._produce, name="rl-experience", daemon=True)
            self._thread.start()
        return self

    # -- the trainer's side (main thread) ------------------------------------------------------------
    def take(self, step: int, guard) -> Experience:
        """Step `step`'s experience: inline now (not threaded), else what the producer made (waited for). Its
        stats get `experience_wait_s`: the seconds the trainer's step spent on it (inline: making it; ahead: the
        wait for the producer), the part of rollout + reward that training did not hide."""
        t = time.monotonic()
        if not self.threaded:
            exp = self._finish(self._rollout(step, guard), guard)
        else:
            with guard.phase("wait_experience", step=step):
                self._wait(lambda: step in self._ready, f"the experience of step {step}", guard)
                with self._cond:
                    exp = self._ready.pop(step)
        exp.stats["experience_wait_s"] = time.monotonic() - t
        return exp

    def before_sync(self, boundary: int, guard) -> None:
        """Before the weights of version `boundary` reach the engines: wait until every step scheduled on
        older weights (m <= boundary - 1 + k) is rolled out."""
        if not self.threaded:
            return
        target = min(boundary - 1 + self.k, self.last_step - 1)
        # A rollout with no engine left waits for this very sync (await_sync): it finishes on these weights.
        self._wait(lambda: self._rolled_through >= target or self._stalled is not None,
                   f"the rollouts through step {target} (on weights older than version {boundary})", guard)

    def synced(self, boundary: int) -> None:
        """The engines serve version `boundary` now: rollouts scheduled on it may start."""
        with self._cond:
            self._served = boundary
            self._cond.notify_all()

    def await_sync(self, step: int, timeout_s: float, poll_s: float = 1.0) -> bool:
        """The producer, in step `step`'s rollout, has no engine left (the lone engine died or hung): the weights of
        the version it was scheduled on are gone (the trainer has moved on), so the engine's replacement is
        synced by the trainer's next sync instead, to the trainer's own weights, and the rest of the step is
        sampled on them: fresher than its schedule, never staler (staleness stays within k). Waits, bounded
        by `timeout_s`, for that sync; True once it happened. before_sync lets that sync go ahead meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            served, self._stalled = self._served, step
            self._producing = (step, "rollout: no engine left, waiting for the trainer's next sync")
            self._cond.notify_all()
            try:
                while self._served == served and not self._closed and time.monotonic() < deadline:
                    self._cond.wait(poll_s)
                return self._served != served and not self._closed
            finally:
                self._stalled = None
                self._producing = (step, "rollout")

    def buffered(self, boundary: int, guard) -> dict[int, Experience]:
        """What a checkpoint at step boundary `boundary` must keep: steps boundary .. boundary + k - 1,
        made on weights older than the checkpoint's (waits for their rewards)."""
        if not self.threaded or self.k == 0:
            return {}
        steps = range(boundary, min(boundary + self.k, self.last_step))
        self._wait(lambda: all(m in self._ready for m in steps),
                   f"the rewards of steps {steps.start}..{steps.stop - 1} for the checkpoint", guard)
        with self._cond:
            return {m: self._ready[m] for m in steps}

    def stop(self) -> None:
        """Stop the producer at its next wait and forget what it made (idempotent, returns at once)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """`stop`, then wait (bounded) for the producer thread to end."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("experience producer still in %s after %.0f s; left behind (daemon thread)",
                            self._producing, timeout_s)

    def _wait(self, ready: Callable[[], bool], what: str, guard) -> None:
        """Polled on the condition; beats `guard` when the producer progressed; raises its error."""
        started = last_log = time.monotonic()
        seen = self.guard.beats
        with self._cond:
            while not ready():
                if self._error is not None:
                    raise self._error[1]
                if self._closed:
                    raise RlslurmError(f"the experience pipeline was closed while waiting for {what}")
                self._cond.wait(self.poll_s)
                if self.guard.beats != seen:
                    seen = self.guard.beats
                    guard.beat()
                now = time.monotonic()
                if now - last_log > self.log_every_s:
                    last_log = now
                    log.info("waiting %.0f s for %s; producer at %s", now - started, what, self._producing)

    # -- the producer (thread rl-experience) -------------------------------------------------------
    def _produce(self) -> None:
        for m in range(self._next, self.last_step):
            with self._cond:
                while not self._closed and self._served < m - self.k:
                    self._producing = (m, f"waiting for version {m - self.k} (engines serve {self._served})")
                    self._cond.wait()
                if self._closed:
                    return
                self._producing = (m, "rollout")
            try:
                pending = self._rollout(m, self.guard)
                with self._cond:
                    self._rolled_through = m
                    self._producing = (m, "reward")
                    self._cond.notify_all()
                exp = self._finish(pending, self.guard)
            except BaseException as e:  # raised in the main thread by whoever waits for this step
                with self._cond:
                    if not self._closed:  # a drain refusing the next rollout lands here too: not fatal yet
                        log.warning("experience of step %d failed (raised when the trainer waits for it): %s: %s",
                                    m, type(e).__name__, e)
                    self._error = (m, e)
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[m] = exp
                self._producing = None
                self._cond.notify_all()

"""The chain of timeouts a job runs under, in the order they must fire, and the orders that cannot work.

    chain = timeout_chain(job, step_s=plan.rl_step_s.value)
    print("\\n".join(chain.lines()))   # `rlslurm plan`: each timeout led by its value, then every order checked
    chain.problems()                  # `rlslurm submit` refuses these: both keys, the numbers and the fix

A stall is met by the innermost timeout first and by the outermost last. Each order below says which must
come first and what happens when it does not:

1. The caller's own timeout before the watchdog: a rollout request (`rollout.request_timeout_s`), a sync
   stage (`sync.timeout_s`), a scoring request with its retries (`reward.timeout_s`, `retries`,
   `retry_backoff_s`) must give up before the node agent's phase timeout of that phase, or the watchdog
   requeues the whole job for what the step would have survived (a dead engine's prompts go to the others).
2. The reward supervisor before the scoring requests give up: one health check (`health_timeout_s`) must
   not outlast one scoring request (`timeout_s`), or the requests fail the step while the supervisor still
   waits to act. The whole detection of a hung service (`unhealthy_after` x (`health_interval_s` +
   `health_timeout_s`)) past the requests' whole budget is a note: those responses are degraded by policy.
3. The watchdog before the collective timeout: a rank waits for a hung peer in a collective for
   `train.dist_timeout_s`; the watchdog looks after the longest trainer phase timeout + one poll
   (`diag.*`). The other way round the waiting ranks raise first, and the watchdog finds them dead and the
   hang's evidence gone.
4. On SLURM, the drain before the time limit: the pre-timeout signal (`cluster.signal_before_s`) must leave
   room for the step in flight (the plan's step time) and a checkpoint (`checkpoint.cost_s`), or the
   step and the drain checkpoint are lost to the kill.
5. On SLURM, KillWait (`checkpoint.kill_wait_s`) against a checkpoint: SIGTERM (preemption, an external
   requeue) saves only if C fits, else the job resumes from its last periodic checkpoint. A note, not a
   refusal: the periodic checkpoint is the designed fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlslurm.config import JobConfig
from rlslurm.diag.config import PHASES

TRAINER_PHASES = tuple(p for p in PHASES if p not in ("score", "idle"))
"""Phases a trainer rank goes through (score and idle are the reward service's): while one rank is in any of
them, its peers may wait for it in a collective (the step boundary, the experience broadcast, a save)."""


@dataclass(frozen=True)
class Timeout:
    """One timeout of the chain: its value, the key(s) that set it, and what it bounds."""

    value_s: float
    key: str
    meaning: str


@dataclass(frozen=True)
class Order:
    """One order of the chain: `first` (seconds, how) must fire before `then`; `ok` says whether it does."""

    first_s: float
    first: str
    then_s: float
    then: str
    ok: bool
    consequence: str
    fix: str
    refuse: bool = True
    """False: a note only (the job still runs as designed, with less margin)."""
    fits: bool = False
    """The order reads `first fits in then` (a duration within a window), not `first fires before then`."""

    def line(self) -> str:
        verdict = "ok" if self.ok else ("REFUSE" if self.refuse else "note")
        relation = ("fits in" if self.ok else "does NOT fit in") if self.fits else \
            ("fires before" if self.ok else "does NOT fire before")
        text = f"{verdict:<6}  {_s(self.first_s)} {self.first} {relation} {_s(self.then_s)} {self.then}"
        return text if self.ok else f"{text}: {self.consequence}; {self.fix}"

    def problem(self) -> str:
        relation = "does not fit in" if self.fits else "does not fire before"
        return (f"timeout chain: {self.first} = {_s(self.first_s)} {relation} {self.then} = "
                f"{_s(self.then_s)}: {self.consequence}; {self.fix}")


@dataclass(frozen=True)
class Chain:
    """The timeouts of one job and every order between them."""

    timeouts: list[Timeout] = field(default_factory=list)
    orders: list[Order] = field(default_factory=list)

    def problems(self) -> list[str]:
        """The orders that cannot work: `rlslurm submit` refuses the job for each."""
        return [o.problem() for o in self.orders if not o.ok and o.refuse]

    def lines(self) -> list[str]:
        """The text `rlslurm plan` prints: the values first, then the orders."""
        width = max((len(_s(t.value_s)) for t in self.timeouts), default=1)
        out = ["timeout chain (seconds; each must fire before the ones it protects):"]
        keys = max((len(t.key) for t in self.timeouts), default=1)
        out += [f"  {_s(t.value_s):>{width}}  {t.key:<{keys}}  {t.meaning}" for t in self.timeouts]
        out += [f"  {o.line()}" for o in self.orders]
        return out

    def as_json(self) -> dict:
        return {"timeouts_s": {t.key: t.value_s for t in self.timeouts},
                "orders": [{"first": o.first, "first_s": o.first_s, "then": o.then, "then_s": o.then_s,
                            "ok": o.ok, "refuse": o.refuse} for o in self.orders]}


def _s(value: float) -> str:
    return f"{value:,.4g} s" if value < 1000 else f"{value:,.0f} s"


def _longest_trainer_phase(job: JobConfig) -> tuple[float, str]:
    """The longest phase timeout a trainer rank runs under, and the key that sets it."""
    diag = job.diag
    key, value = "diag.hang_timeout_s", diag.hang_timeout_s
    for phase in TRAINER_PHASES:
        if phase in diag.phase_timeouts_s and diag.phase_timeouts_s[phase] > value:
            key, value = f"diag.phase_timeouts_s.{phase}", diag.phase_timeouts_s[phase]
    return value, key


def _phase_key(job: JobConfig, phase: str) -> str:
    return f"diag.phase_timeouts_s.{phase}" if phase in job.diag.phase_timeouts_s else "diag.hang_timeout_s"


def reward_request_budget_s(job: JobConfig) -> float:
    """Seconds one response may spend in scoring requests before it is degraded: every attempt's timeout
    and the backoff between them (rlslurm/reward/client.py)."""
    rw = job.reward
    return (rw.retries + 1) * rw.timeout_s + rw.retry_backoff_s * (2 ** rw.retries - 1)


def reward_unhealthy_after_s(job: JobConfig) -> float:
    """Seconds before the supervisor declares a hung service unhealthy: `unhealthy_after` checks in a row,
    each waiting an interval and then its timeout (rlslurm/reward/supervisor.py)."""
    rw = job.reward
    return rw.unhealthy_after * (rw.health_interval_s + rw.health_timeout_s)


def timeout_chain(job: JobConfig, step_s: float) -> Chain:
    """The chain of `job` (see the module docstring); `step_s` is the plan's step time (the drain's step)."""
    d, ck, cl = job.diag, job.checkpoint, job.cluster
    rl = job.job.kind == "rl"
    on_slurm = cl.backend != "local"
    watch_s, (phase_s, phase_key) = d.watch_interval_s, _longest_trainer_phase(job)
    timeouts = [Timeout(watch_s, "diag.watch_interval_s", "the node agent reads the heartbeats"),
                Timeout(phase_s, phase_key, "no progress -> hung (the longest phase timeout of a trainer rank)"),
                Timeout(job.train.dist_timeout_s, "train.dist_timeout_s",
                        "a rank waiting in a collective (or the rendezvous) gives up")]
    orders: list[Order] = []
    if rl:
        _caller_orders(job, timeouts, orders)
    detect_s = phase_s + watch_s
    orders.append(Order(
        detect_s, f"watchdog ({phase_key} + diag.watch_interval_s)", job.train.dist_timeout_s, "train.dist_timeout_s",
        detect_s < job.train.dist_timeout_s,
        "the ranks waiting in a collective for a hung peer raise first, and the watchdog sees only dead ranks "
        "(no stacks of the wait, no names)",
        f"set train.dist_timeout_s above {_s(detect_s)} (torch's own default is 1,800 s), or lower {phase_key}"))
    if on_slurm:
        drain_s = step_s + ck.cost_s
        timeouts += [Timeout(ck.cost_s, "checkpoint.cost_s", "one checkpoint (until measured)"),
                     Timeout(step_s, "drain: one step", "the step in flight when the signal comes (the plan's step)"),
                     Timeout(cl.signal_before_s, "cluster.signal_before_s",
                             "the pre-timeout signal, before the time limit"),
                     Timeout(ck.kill_wait_s, "checkpoint.kill_wait_s", "SIGTERM -> SIGKILL (SLURM's KillWait)")]
        orders.append(Order(
            drain_s, "drain + checkpoint.cost_s", cl.signal_before_s, "cluster.signal_before_s",
            drain_s <= cl.signal_before_s,
            "the time limit kills the job before the step in flight and its checkpoint are done: the step is lost "
            "and the job resumes from its last periodic checkpoint",
            f"set cluster.signal_before_s to at least {_s(drain_s)} (one step {_s(step_s)} + checkpoint "
            f"{_s(ck.cost_s)}), or lower checkpoint.cost_s if a save is faster", fits=True))
        orders.append(Order(
            ck.cost_s, "checkpoint.cost_s", ck.kill_wait_s, "checkpoint.kill_wait_s", ck.cost_s <= ck.kill_wait_s,
            "on SIGTERM (preemption, an external requeue) the job does not save: it resumes from its last "
            "periodic checkpoint", "expected on clusters with a short KillWait", refuse=False, fits=True))
    return Chain(timeouts, orders)


def _caller_orders(job: JobConfig, timeouts: list[Timeout], orders: list[Order]) -> None:
    """Orders 1 and 2 of the module docstring: each caller's timeout against the watchdog and the supervisor."""
    d, rw = job.diag, job.reward
    for phase, key, value_s, what in (
            ("rollout", "rollout.request_timeout_s", job.rollout.request_timeout_s, "a generation request"),
            ("sync", "sync.timeout_s", job.sync.timeout_s, "a weight-sync stage")):
        timeouts.append(Timeout(value_s, key, f"{what} gives up"))
        limit = d.timeout_for(phase)
        orders.append(Order(
            value_s, key, limit, _phase_key(job, phase), value_s <= limit,
            f"the watchdog requeues the whole job while {what} still waits, before the controller can act on it "
            "(a dead engine's prompts go to the others, a failed sync is retried or named)",
            f"set {key} at most {_s(limit)}, or raise {_phase_key(job, phase)}"))
    if rw.service == "inline":
        return
    budget_s, unhealthy_s = reward_request_budget_s(job), reward_unhealthy_after_s(job)
    budget_key = "(reward.retries + 1) x reward.timeout_s + reward.retry_backoff_s backoffs"
    timeouts += [Timeout(budget_s, f"reward: {rw.retries + 1} x timeout_s + backoffs",
                         "one response gives up and is degraded (reward.timeout_s, retries, retry_backoff_s)"),
                 Timeout(unhealthy_s, f"reward: {rw.unhealthy_after} x (health_interval_s + health_timeout_s)",
                         "the supervisor restarts a hung service")]
    orders.append(Order(
        rw.health_timeout_s, "reward.health_timeout_s", rw.timeout_s, "reward.timeout_s",
        rw.health_timeout_s <= rw.timeout_s,
        "a scoring request gives up while the supervisor still waits for one health check of the same service, "
        "so a hung service fails the step's responses before the supervisor acts on it",
        f"set reward.health_timeout_s at most {_s(rw.timeout_s)}, or raise reward.timeout_s"))
    orders.append(Order(
        unhealthy_s, "reward.unhealthy_after x (reward.health_interval_s + reward.health_timeout_s)", budget_s,
        budget_key, unhealthy_s < budget_s,
        f"a response to a hung service is degraded (reward.degrade = {rw.degrade!r}) before the supervisor "
        "restarts it (a dead service is restarted at the next check)",
        "lower reward.unhealthy_after or health_interval_s, or raise reward.retries", refuse=False))
    limit = d.timeout_for("reward")
    orders.append(Order(
        budget_s, budget_key, limit, _phase_key(job, "reward"), budget_s <= limit,
        "the watchdog requeues the whole job while a response still waits for its retries",
        f"raise {_phase_key(job, 'reward')} above {_s(budget_s)}, or lower reward.timeout_s or reward.retries"))

"""Whether SLURM suspended the job (`scontrol suspend`): the node agent's view, so a suspended job is no hang.

    watch = SuspendWatch(run, host="n1", job_state=slurm_job_state, clock=time.time)
    watch.unobserved(overrun_s, watched)       # the agent's own wait overran: it was stopped; ages from now
    if hung and watch.holds(watched, state):   # every rank of the node stopped and SLURM says SUSPENDED
        ...                                    # nobody is judged; ages count from `watch.resumed_at` later

SLURM suspends a job by stopping every process of its steps' trees (measured on 22.05, proctrack/linuxproc:
SIGTSTP, SIGSTOP ~2 s later, SIGCONT on the resume): the ranks, the engine servers, the reward service and the
node agent too, whatever their sessions. So the ranks' heartbeats age while nobody runs, and on `scontrol
resume` the agent found them older than their phase timeouts: a hang called on a job that only waited, and a
requeue (issue 38, measured on 5e8c18c). So:

- the agent notices that it was not running itself: a wait of `diag.watch_interval_s` that took many times
  longer (`unobserved`) means it was stopped (or starved): ages count from then, since nobody can tell a
  hang from what it did not see (one `job_suspended` event saying how long);
- where it runs on while the ranks are stopped, every rank it judged hung stopped (state T) and SLURM calling
  the job SUSPENDED means not hung (`holds`; one event); once they run again, ages count from then.

One stopped rank among running ones is a fault (a SIGSTOP) and stays a hang, as does a job SLURM does not call
SUSPENDED (off SLURM SLURM says nothing: a hang as before).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import psutil

from rlslurm import events
from rlslurm.rundir import RunDir

log = logging.getLogger("rlslurm.watchdog")

_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def slurm_job_state() -> str | None:
    """SLURM's JobState of this job (SUSPENDED, RUNNING, ...), or None off SLURM or when it does not answer."""
    from rlslurm.errors import SlurmCommandError, SlurmParseError
    from rlslurm.lifecycle import leader_job_id
    from rlslurm.slurm import commands, parse

    job = leader_job_id()
    if job is None:
        return None
    try:
        return parse.job_state(commands.show_job(job))
    except (SlurmCommandError, SlurmParseError) as e:
        log.warning("job %s: state unknown (%s)", job, e)
        return None


MISSED_S = 5.0
"""A wait that overran by more than this (and five watch intervals) is time the agent did not see."""


class SuspendWatch:
    """The node agent's knowledge of a suspension (see the module docstring)."""

    def __init__(self, run: RunDir, *, host: str, job_state: Callable[[], str | None] = slurm_job_state,
                 clock: Callable[[], float]):
        self.run, self.host, self.job_state, self.clock = run, host, job_state, clock
        self.suspended = False
        self.resumed_at = 0.0
        """Wall time of the last resume seen (0: none): heartbeat ages count from it."""

    def unobserved(self, overrun_s: float, watched: Callable[[], Sequence], interval_s: float = 1.0) -> bool:
        """After one wait of the agent's loop that overran by `overrun_s`: True (and ages count from now) when that
        is time the agent did not see (stopped with the job, say), so no rank is judged on it."""
        if overrun_s <= max(MISSED_S, 5 * interval_s):
            return False
        self.resumed_at = self.clock()
        ranks = [f"{r.hb.get('role')}-{r.hb.get('rank')}" for r in watched()]
        log.info("this agent did not run for %.1f s (a suspend stops it with the job): heartbeat ages count from now",
                 overrun_s)
        events.emit(self.run, events.JOB_SUSPENDED, role="agent", node=self.host, ranks=ranks,
                    slurm_state=self.job_state(), unobserved_s=round(overrun_s, 1))
        return True

    def holds(self, ranks: Sequence, state: Callable[[int], str]) -> bool:
        """Whether judging `ranks` (those found past their timeout, each with its heartbeat `hb`) must wait:
        they are all stopped and SLURM says the job is suspended, or they run again after a suspension seen
        (then ages count from now)."""
        stopped = [r for r in ranks if state(int(r.hb.get("pid"))) in _STOPPED]
        if self.suspended and len(stopped) < len(ranks):
            self.suspended, self.resumed_at = False, self.clock()
            log.info("the job runs again after its suspension: heartbeat ages count from now")
            return True
        if not ranks or len(stopped) < len(ranks):
            return False
        slurm_says = self.job_state()
        if slurm_says != "SUSPENDED":
            return False
        if not self.suspended:
            self.suspended = True
            log.info("every rank of %s stopped and SLURM says SUSPENDED: not judged until it runs again", self.host)
            events.emit(self.run, events.JOB_SUSPENDED, role="agent", node=self.host,
                        ranks=[f"{r.hb.get('role')}-{r.hb.get('rank')}" for r in ranks], slurm_state=slurm_says)
        return True

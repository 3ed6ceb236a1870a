"""What a run met and went on through, told from its events: every engine, the reward service's deaths and
restarts, its workers' deaths, and a drain on SLURM's SIGTERM (a preemption).

    lines = engine_lines(now_events, heartbeats)   # ["engine 0: 2 deaths, down past rollout.max_restarts ...",
                                                   #  "engine 1: served throughout (no death, no hang)"]
    cause = preemption(now_events, slurm_state)    # a Cause("preempted", ...) or None

`rlslurm diag` (diag/summary.py) puts these lines under its cause: the headline of a job that finished stays
"finished OK", and what it survived is listed, not left out (issue 38: diag never mentioned the engine that
served on, nor a reward service restart, nor a reward worker's death).
"""

from __future__ import annotations

from rlslurm import events as ev

ENGINE_KINDS = (ev.ENGINE_DIED, ev.ENGINE_UNHEALTHY, ev.ENGINE_RESTARTED, ev.ENGINE_DOWN, ev.ENGINE_OUT,
                ev.ENGINE_READMITTED)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def engine_lines(now_events: list[dict], heartbeats: list[dict]) -> list[str]:
    """One line per rollout engine of this attempt, once any engine met a fault: what happened to it, and
    which served throughout. [] when no engine met any (nothing to tell)."""
    faults = ev.select(now_events, ev.ENGINE_DIED, ev.ENGINE_UNHEALTHY, ev.ENGINE_DOWN, ev.ENGINE_OUT)
    if not faults:
        return []
    seen = {int(e["engine"]) for e in ev.select(now_events, *ENGINE_KINDS) if isinstance(e.get("engine"), int)}
    seen |= {int(hb["rank"]) for hb in heartbeats if hb.get("role") == "rollout" and isinstance(hb.get("rank"), int)}
    lines = []
    for i in sorted(seen):
        mine = [e for e in ev.select(now_events, *ENGINE_KINDS) if e.get("engine") == i]
        died = ev.select(mine, ev.ENGINE_DIED)
        hung = ev.select(mine, ev.ENGINE_UNHEALTHY)
        out = ev.select(mine, ev.ENGINE_OUT)
        down = ev.select(mine, ev.ENGINE_DOWN)
        replaced = ev.select(mine, ev.ENGINE_RESTARTED)
        back = ev.select(mine, ev.ENGINE_READMITTED)
        if not (died or hung or out or down):
            lines.append(f"engine {i}: served throughout (no death, no hang, never out of rotation)")
            continue
        what = [_plural(len(died), "death")] if died else []
        what += [_plural(len(hung), "hang")] if hung else []
        what += [f"{_plural(len(replaced), 'replacement')} by its supervisor"] if replaced else []
        if down:
            d = down[-1]
            end = (f"down past rollout.max_restarts = {d.get('max_restarts')} on {d.get('node')}: out of rotation "
                   f"for good, the others served on")
        elif back:
            end = f"back in rotation at version {back[-1].get('version')} (VERIFIED)"
        elif out:
            end = f"out of rotation ({out[-1].get('cause')})"
        else:
            end = "not taken out of rotation (no request of the controller met it)"
        lines.append(f"engine {i}: {', '.join(what + [end])}")
    return lines


def reward_lines(now_events: list[dict]) -> list[str]:
    """The reward service's deaths, hangs and restarts, and its workers' deaths, one line each (the service's
    giving up is a cause of its own: summary's reward_down)."""
    lines = []
    for e in ev.select(now_events, ev.REWARD_SERVICE_DIED, ev.REWARD_SERVICE_UNHEALTHY, ev.REWARD_SERVICE_RESTARTED,
                       ev.REWARD_SERVICE_START_FAILED, ev.REWARD_WORKER_DIED):
        kind = ev.kind_of(e)
        if kind == ev.REWARD_SERVICE_DIED:
            lines.append(f"reward service died (pid {e.get('pid')}, exit code {e.get('exit_code')})")
        elif kind == ev.REWARD_SERVICE_UNHEALTHY:
            lines.append(f"reward service unhealthy (pid {e.get('pid')}, {e.get('failed_checks')} failed health "
                         f"checks): killed")
        elif kind == ev.REWARD_SERVICE_RESTARTED:
            lines.append(f"reward service restarted by its supervisor (restart {e.get('restarts')}, pid "
                         f"{e.get('pid')}, serving {e.get('start_s')} s after; reason: {e.get('reason')})")
        elif kind == ev.REWARD_SERVICE_START_FAILED:
            lines.append(f"reward service restart {e.get('attempt')} did not start: {e.get('error')}")
        else:
            lines.append(f"reward worker ({e.get('what')}) pid {e.get('worker_pid')} died while scoring (exit code "
                         f"{e.get('exit_code')}): its item unscored, a fresh worker took its slot")
    return lines


def sigterm_drain(event: dict) -> bool:
    """Whether a `drained` event is a drain on SLURM's SIGTERM."""
    return ev.DRAINED.matches(event) and event.get("signal") == "SIGTERM"


def preemption(now_events: list[dict], slurm_state: str) -> tuple[str, list[str]] | None:
    """(headline, evidence) when this attempt drained on SLURM's SIGTERM: every rank got it (from SLURM, or
    from the trainer supervisor that passed the batch step's on: `job_sigterm`) and checkpointed."""
    drained = [e for e in now_events if sigterm_drain(e)]
    if not drained:
        return None
    e = drained[-1]
    ckpt = (f"checkpoint {e['checkpoint']}, where it resumes" if e.get("checkpoint")
            else "no drain checkpoint (it resumes from the newest complete one)")
    if slurm_state in ("PENDING", "REQUEUED", "RUNNING", "CONFIGURING"):
        after = "SLURM requeued it: it resumes by itself"
    else:
        after = "if SLURM does not requeue it (`scontrol requeue`), `rlslurm resume` continues it"
    relayed = ev.select(now_events, ev.JOB_SIGTERM)
    evidence = [f"drained: {e.get('reason')}"]
    if relayed:
        evidence.append(f"the trainer supervisor passed SIGTERM on to components {relayed[-1].get('components')}: "
                        f"{relayed[-1].get('relayed')}")
    return (f"preempted by SLURM: SIGTERM to the job (a preemption, `scontrol requeue`, the time limit or "
            f"`scancel --signal=TERM`); every rank drained at step {e.get('step')} ({ckpt}); {after}", evidence)


def earlier_line(e: dict) -> str:
    """An earlier attempt's ending event, as the evidence of the current one says it."""
    if sigterm_drain(e):
        return (f"earlier attempt: preempted by SLURM (SIGTERM): drained at step {e.get('step')}, checkpoint "
                f"{e.get('checkpoint')}")
    said = str(e.get("message") or e.get("reason") or e.get("cause") or e.get("error") or "")
    return f"earlier attempt: {e.get('kind')} {said}".rstrip()

"""Why did the job die (or hang)? The cause classifier behind `rlslurm diag`.

    facts = Facts(events=..., heartbeats=..., logs={"train-0.log": tail}, slurm_state="TIMEOUT", ...)
    causes = classify(facts)          # most likely first; causes[0].headline is what diag prints

Rules are tried in an order that puts a root cause before its symptoms: an OOM or a hang also leaves a
Python traceback or a killed rank behind, a preemption leaves a SIGTERM, so those come first and the
generic "Python exception" late. Only the events of the current attempt count (after the last `start`
or `resume` event of rlslurm.lifecycle); earlier attempts are listed as evidence.

Event kinds read: hang_detected (diag/watchdog.py), phase_failed (diag/guard.py), sync_failed /
sync_verify_failed, engine_crashed / engine_died / rollout_failed, reward_down / reward_failed /
reward_service_down, preempted, oom, preflight_failed, finished / done / job_finished, start / resume.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

from rlslurm.diag.heartbeat import label, pid_alive
from rlslurm.node import node_name


@dataclass
class Facts:
    events: list[dict] = field(default_factory=list)
    heartbeats: list[dict] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    """Log name -> its tail."""
    slurm_state: str | None = None
    """State from scontrol / sacct: RUNNING, COMPLETED, FAILED, TIMEOUT, PREEMPTED, NODE_FAIL, OUT_OF_MEMORY ..."""
    env_errors: list[str] = field(default_factory=list)
    now: float = field(default_factory=time.time)
    host: str = field(default_factory=node_name)


@dataclass
class Cause:
    kind: str
    """oom, hang, sync_failure, engine_crash, reward_down, node_failure, time_limit, preempted,
    env_mismatch, exception, running, finished, unknown."""
    headline: str
    evidence: list[str] = field(default_factory=list)


_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|oom-kill|oom_kill|Out of memory|MemoryError")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):\n(?:.*\n)*?\S.*(?:Error|Exception|Interrupt|Exit)\b.*",
                        re.MULTILINE)
_ENGINE = re.compile(r"EngineDeadError|EngineCore\S* (?:died|failed)|engine (?:died|crashed)", re.IGNORECASE)


def current_attempt(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(events since the last start/resume, events before it)."""
    starts = [i for i, e in enumerate(events) if e.get("kind") in ("start", "resume")]
    cut = starts[-1] if starts else 0
    return events[cut:], events[:cut]


def _kinds(events: list[dict], *kinds: str) -> list[dict]:
    return [e for e in events if e.get("kind") in kinds]


def _grep(logs: dict[str, str], pattern: re.Pattern, names: Callable[[str], bool] = lambda n: True):
    for name, text in sorted(logs.items()):
        if names(name):
            m = pattern.search(text)
            if m:
                return name, m
    return None


def _alive(facts: Facts) -> list[dict]:
    """Heartbeats of processes that still run: pid alive here, or fresh on another host."""
    out = []
    for hb in facts.heartbeats:
        if hb.get("state") != "running":
            continue
        if hb.get("host") == facts.host:
            if pid_alive(hb):
                out.append(hb)
        elif facts.now - float(hb.get("last_progress") or 0) < float(hb.get("phase_timeout_s") or 300):
            out.append(hb)
    return out


def classify(facts: Facts) -> list[Cause]:
    """Every cause the facts support, most likely first; never empty (falls back to `unknown`)."""
    now_events, earlier = current_attempt(facts.events)
    state = (facts.slurm_state or "").upper()
    alive = _alive(facts)
    causes: list[Cause] = []

    if facts.env_errors or _kinds(now_events, "preflight_failed"):
        msgs = facts.env_errors + [str(e.get("message")) for e in _kinds(now_events, "preflight_failed")]
        causes.append(Cause("env_mismatch", f"env mismatch: {msgs[0]}", msgs[1:]))
    oom = _grep(facts.logs, _OOM)
    if state == "OUT_OF_MEMORY" or _kinds(now_events, "oom") or (oom and not alive):
        where = f"{oom[0]}: {oom[1].group(0)}" if oom else f"SLURM state {state or 'oom event'}"
        causes.append(Cause("oom", f"out of memory ({where})", _tail_lines(facts.logs, oom[0]) if oom else []))
    for e in _kinds(now_events, "hang_detected")[-1:]:
        coll = e.get("collective")
        waiting = ", ".join(e.get("waiting") or []) or "none"
        stuck = ", ".join(e.get("stuck") or []) or "none"
        head = (f"hang in collective {coll} on ranks {waiting}, waiting on {stuck}" if e.get("collective")
                else f"hang: no progress on {stuck}")
        causes.append(Cause("hang", head, [str(e.get("message")), f"stacks: {e.get('stacks_dir')}"]))
    for e in _kinds(now_events, "sync_failed", "sync_verify_failed")[-1:]:
        causes.append(Cause("sync_failure", f"weight-sync failure: {e.get('message') or e.get('error')}",
                            [str(e)]))
    if not any(c.kind == "sync_failure" for c in causes):
        hit = _grep(facts.logs, re.compile(r"SyncVerifyError.*"))
        if hit:
            causes.append(Cause("sync_failure", f"weight-sync failure ({hit[0]}: {hit[1].group(0)})"))
    engine = _kinds(now_events, "engine_crashed", "engine_died", "rollout_failed")
    hit = _grep(facts.logs, _ENGINE, lambda n: "rollout" in n or "engine" in n)
    if engine or hit:
        what = engine[-1].get("message") or engine[-1].get("error") if engine else f"{hit[0]}: {hit[1].group(0)}"
        causes.append(Cause("engine_crash", f"rollout engine crash: {what}"))
    reward = _kinds(now_events, "reward_down", "reward_failed", "reward_service_down")
    hit = _grep(facts.logs, re.compile(r"RewardServiceError.*"))
    if reward or hit:
        what = reward[-1].get("message") or reward[-1].get("error") if reward else f"{hit[0]}: {hit[1].group(0)}"
        causes.append(Cause("reward_down", f"reward service down: {what}"))
    if state == "NODE_FAIL" or _grep(facts.logs, re.compile(r"NODE_FAIL|DUE TO NODE FAILURE")):
        causes.append(Cause("node_failure", "node failure (SLURM NODE_FAIL)"))
    if state == "TIMEOUT" or _grep(facts.logs, re.compile(r"DUE TO TIME LIMIT")):
        causes.append(Cause("time_limit", "time limit reached (SLURM TIMEOUT)"))
    if state == "PREEMPTED" or _kinds(now_events, "preempted") or _grep(facts.logs, re.compile(r"DUE TO PREEMPTION")):
        causes.append(Cause("preempted", "preempted by SLURM"))
    failed = _kinds(now_events, "phase_failed")
    if failed:
        e = failed[0]  # the first failure is the cause; later ones are usually its echo on other ranks
        causes.append(Cause("exception", f"Python exception in {e.get('role')}-{e.get('rank')} during phase "
                            f"{e.get('phase')} step {e.get('step')}: {e.get('error')}",
                            [str(e.get("traceback", "")).rstrip()]))
    elif not alive:
        hit = _grep(facts.logs, _TRACEBACK)
        if hit:
            causes.append(Cause("exception", f"Python exception ({hit[0]}): {hit[1].group(0).splitlines()[-1]}",
                                [hit[1].group(0)]))
    if alive and not causes:
        steps = sorted({hb.get("step") for hb in alive if hb.get("step") is not None})
        phases = ", ".join(f"{label(hb)} in {hb.get('phase')}" for hb in alive)
        causes.append(Cause("running", f"still running (step {steps[-1] if steps else '?'}; {phases})"))
    exited = [hb for hb in facts.heartbeats if hb.get("state") == "exited"]
    finished = _kinds(now_events, "finished", "done", "job_finished")
    if not causes and (finished or state == "COMPLETED" or (exited and len(exited) == len(facts.heartbeats))):
        causes.append(Cause("finished", "finished OK" + (f" ({len(exited)} processes exited cleanly)" if exited else "")))
    if not causes:
        causes.append(Cause("unknown", f"no cause found (SLURM state {state or 'unknown'}); read the log tails"))
    for e in _kinds(earlier, "hang_detected", "phase_failed", "preempted", "drain"):
        causes[0].evidence.append(f"earlier attempt: {e.get('kind')} {e.get('message') or e.get('error') or ''}".rstrip())
    return causes


def _tail_lines(logs: dict[str, str], name: str, n: int = 15) -> list[str]:
    return logs.get(name, "").splitlines()[-n:]


def render(causes: list[Cause], header: list[str] | None = None) -> str:
    """The text `rlslurm diag` prints: the most likely cause, its evidence, the other findings."""
    first = causes[0]
    lines = list(header or []) + [f"cause: {first.headline}"]
    if first.evidence:
        lines.append("evidence:")
        for item in first.evidence:
            lines.extend("  " + line for line in item.splitlines()[-25:])
    if causes[1:]:
        lines.append("also seen: " + "; ".join(c.headline for c in causes[1:]))
    return "\n".join(lines) + "\n"

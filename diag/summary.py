"""Why did the job die (or hang)? The cause classifier behind `rlslurm diag`.

    facts = Facts(events=..., heartbeats=..., logs={"train-0.log": tail}, slurm_state="TIMEOUT", ...)
    causes = classify(facts)          # most likely first; causes[0].headline is what diag prints

Rules are tried in an order that puts a root cause before its symptoms: an OOM or a hang also leaves a
Python traceback or a killed rank behind, a preemption leaves a SIGTERM, a dead engine or reward service
fails the controller's step, so those come first and the generic "Python exception" late. Only the
events of the current attempt count (after the last `start` or `resume` event of rlslurm.lifecycle);
earlier attempts are listed as evidence.

Event kinds read (declared in rlslurm/events.py, emitted where the failure happens): env_diff (the
controller's check before the first sync), phase_failed (diag/guard.py), hang_detected (diag/watchdog.py;
a desync when its collective records show a rank that skipped or took another collective),
sync_verify_failed / sync_failed (rlslurm/sync/protocol.py), engine_failed (the controller's engine
calls), engine_died / engine_unhealthy / engine_down (an engine's supervisor, rlslurm/rollout/supervisor.py:
an engine crash or hang), reward_service_down (rlslurm/reward/supervisor.py), checkpoint_failed /
checkpoint_skipped (rlslurm/checkpoint.py: a save that failed, a damaged checkpoint a start skipped),
heartbeat_unwritable / heartbeat_restored (diag/heartbeat.py) and node_agent_died (diag/agent.py): the ops
kit's own failures, trainer_restarted / trainer_restarts_spent (rlslurm/slurm/supervisor.py: a rank crash the
job restarted in the allocation is evidence, not the cause), done / sft_finished, start / resume. SLURM's
state and the log tails cover what no process lives to say (node failure, time limit, preemption); a rank
the kernel killed is the node agent's rank_died (diag/deaths.py: its memory cgroup's OOM-kill count).
tests/data/diag/ holds a recorded run of each cause (tests/unit/test_diag_recorded.py).
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from rlslurm import events as ev
from rlslurm.diag import story
from rlslurm.diag.heartbeat import label, pid_alive, still_unwritable
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
    machine: str = field(default_factory=socket.gethostname)
    """This machine's own name: a heartbeat that names it (its `machine`) is judged by its pid here, whatever
    SLURM node name it wears (the local cluster runs five nodes on one machine)."""
    pid_alive: Callable[[dict], bool] = pid_alive
    """Whether a heartbeat's process (on `host`) still runs; a replay of a recorded run injects what was seen."""


@dataclass
class Cause:
    kind: str
    """oom, oom_kill, disk_full, checkpoint_failed, rank_crash, desync, hang, sync_failure, engine_crash, engine_hang,
    reward_down, node_failure, time_limit, preempted, env_mismatch, exception, heartbeat_unwritable, agent_died,
    checkpoint_damaged, running, finished, unknown."""
    headline: str
    evidence: list[str] = field(default_factory=list)


# torch on CPU says "DefaultCPUAllocator: can't allocate memory"; on GPU OutOfMemoryError; the kernel oom-kill.
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|oom-kill|oom_kill|Out of memory|MemoryError|"
                  r"can't allocate memory")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):\n(?:.*\n)*?\S.*(?:Error|Exception|Interrupt|Exit)\b.*",
                        re.MULTILINE)
_FAILED_NODE = re.compile(r"ON (\S+) CANCELLED AT \S+ DUE TO NODE FAILURE|Node failure on (\S+)")
_ENGINE = re.compile(r"EngineDeadError|EngineCore\S* (?:died|failed)|engine (?:died|crashed)", re.IGNORECASE)


def current_attempt(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(events since the last start/resume, events before it)."""
    starts = [i for i, e in enumerate(events) if ev.kind_of(e) in (ev.START, ev.RESUME)]
    cut = starts[-1] if starts else 0
    return events[cut:], events[:cut]


_STOPPING = re.compile(r"\[shutdown\] API server: shutdown triggered")
"""vLLM's own line when its server was asked to stop (SIGTERM at the job's end, or its supervisor's stop)."""


def before_stop(text: str) -> str:
    """An engine log up to the stop it was asked for: vLLM's client can log EngineDeadError while it tears its
    EngineCore down on a clean SIGTERM (measured on a COMPLETED job), which is no crash."""
    m = _STOPPING.search(text)
    return text[: m.start()] if m else text


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
        if hb.get("host") == facts.host or hb.get("machine") == facts.machine:
            if facts.pid_alive(hb):
                out.append(hb)
        elif facts.now - float(hb.get("last_progress") or 0) < float(hb.get("phase_timeout_s") or 300):
            out.append(hb)
    return out


def _said(e: dict) -> str:
    """What an event says in words: its message, reason, cause or error, whichever it carries."""
    return str(e.get("message") or e.get("reason") or e.get("cause") or e.get("error") or "")


def classify(facts: Facts) -> list[Cause]:
    """Every cause the facts support, most likely first; never empty (falls back to `unknown`)."""
    now_events, earlier = current_attempt(facts.events)
    state = (facts.slurm_state or "").upper()
    alive = _alive(facts)
    causes: list[Cause] = []

    refused = [e for e in ev.select(now_events, ev.ENV_DIFF) if e.get("ok") is False]
    if facts.env_errors or refused:
        msgs = facts.env_errors + [line.removeprefix("error: ") for e in refused
                                   for line in str(e.get("report")).splitlines() if line.startswith("error:")]
        causes.append(Cause("env_mismatch", f"env mismatch: {msgs[0] if msgs else 'see env-diff.txt'}", msgs[1:]))
    for e in [e for e in ev.select(now_events, ev.RANK_DIED) if e.get("oom_killed")][:1]:
        # The node agent read the kernel's own count (diag/deaths.py): the rank left no word of its own.
        causes.append(Cause("oom_kill", f"out of memory: the kernel's OOM killer killed {label(e)} (pid "
                            f"{e.get('rank_pid')} on {e.get('host')}) {when(e)} "
                            f"({oom_evidence(e)})", _symptoms(facts, now_events, alive)))
    oom = _grep(facts.logs, _OOM)
    oom_failed = [e for e in ev.select(now_events, ev.PHASE_FAILED) if _OOM.search(str(e.get("error")))]
    if state == "OUT_OF_MEMORY" or oom_failed or (oom and not alive):
        if oom_failed:
            e = oom_failed[0]
            where = f"{e.get('role')}-{e.get('rank')} {when(e)}: {e.get('error')}"
        else:
            where = f"{oom[0]}: {oom[1].group(0)}" if oom else f"SLURM state {state}"
        forced = [f"submitted with --force past the plan's pre-flight: {problem}"
                  for e in ev.select(facts.events, ev.PREFLIGHT_FORCED) for problem in e.get("problems") or []]
        causes.append(Cause("oom", f"out of memory ({where})",
                            forced + (_tail_lines(facts.logs, oom[0]) if oom else [])))
    for e in ev.select(now_events, ev.CHECKPOINT_FAILED)[:1]:
        # A failed save raises in its rank (phase_failed, often a torch serialization error that hides the
        # errno): the save and what it met are the cause.
        kept = f"the newest complete checkpoint {e['newest_complete']} is intact and is what resume takes" if \
            e.get("newest_complete") else "no complete checkpoint was written before it"
        free = f"{e['free_bytes']:,} bytes free" if e.get("free_bytes") is not None else "free space unknown"
        what = "no space left on device" if e.get("disk_full") else "checkpoint write failed"
        causes.append(Cause("disk_full" if e.get("disk_full") else "checkpoint_failed",
                            f"{what} while checkpointing step {e.get('step')} ({e.get('role')}-{e.get('rank')}: "
                            f"{free} on {e.get('filesystem')}); {kept}", [str(e.get("error"))]))
    crashed = rank_crashes(facts, now_events, alive)
    if crashed and not any(c.kind == "oom_kill" for c in causes):
        causes.append(crashed)
    for e in ev.select(now_events, ev.HANG_DETECTED)[-1:]:
        coll = e.get("collective")
        waiting = ", ".join(e.get("waiting") or []) or "none"
        stuck = ", ".join(e.get("stuck") or []) or "none"
        who = e.get("attribution") or {}
        evidence = [str(e.get("message")), f"stacks: {e.get('stacks_dir')}"] + (
            [f"collective records: {e['records']}"] if e.get("records") else [])
        if who.get("verdict") in ("skipped", "desync"):
            # The ranks took different collectives: the hang is its symptom, the rank that broke step is the cause.
            causes.append(Cause("desync", f"collective desync: {who.get('message')}", evidence))
            continue
        head = (f"hang in collective {coll} on ranks {waiting}, waiting on {stuck}" if e.get("collective")
                else f"hang: no progress on {stuck}")
        if who.get("verdict") == "behind":
            head += f" ({who.get('message')})"
        causes.append(Cause("hang", head, evidence))
    # An engine that died or hung fails the step's rollout or the sync stage in flight: name the engine first.
    causes += engine_causes(now_events, facts.logs)
    for e in ev.select(now_events, ev.SYNC_VERIFY_FAILED)[-1:]:
        bad = e.get("mismatches") or [{}]
        first = bad[0]
        at = f" at step {e['step']}" if e.get("step") is not None else ""
        count = f"{len(bad)}{'+' if len(bad) >= 8 else ''}"  # the event keeps the first 8
        causes.append(Cause("sync_failure", f"weight-sync VERIFY failed{at}: the sync to version {e.get('version')} "
                            f"via {e.get('transport')} left {count} tensors differing on {e.get('engine')} after "
                            f"{e.get('attempts')} attempts (first {first.get('name')!r}: expected "
                            f"{first.get('expected')}, engine has {first.get('actual')})",
                            [f"{m.get('engine')} {m.get('name')}: expected {m.get('expected')}, engine has "
                             f"{m.get('actual')}" for m in bad] + [f"rollback: {e.get('rollback')}"]))
    if not any(c.kind == "sync_failure" for c in causes):
        for e in ev.select(now_events, ev.SYNC_FAILED)[-1:]:
            stage = f" in stage {e['stage']}" if e.get("stage") else ""
            version = f" (version {e['version']})" if e.get("version") is not None else ""
            causes.append(Cause("sync_failure", f"weight-sync failure{stage}{version}: {_said(e)}", [str(e)]))
    if not any(c.kind == "sync_failure" for c in causes):
        hit = _grep(facts.logs, re.compile(r"SyncVerifyError.*"))
        if hit:
            causes.append(Cause("sync_failure", f"weight-sync failure ({hit[0]}: {hit[1].group(0)})"))
    reward = ev.select(now_events, ev.REWARD_SERVICE_DOWN)
    hit = _grep(facts.logs, re.compile(r"RewardServiceError.*"))
    if reward:
        e = reward[-1]
        causes.append(Cause("reward_down", f"reward service down: gone past its restart budget "
                            f"({e.get('restarts')} restarts, {e.get('attempts')} tried, reward.max_restarts = "
                            f"{e.get('max_restarts')}; last: {e.get('reason')}) on {e.get('host')}",
                            [f"service log: {e.get('log')}"]))
    elif hit:
        causes.append(Cause("reward_down", f"reward service down: {hit[0]}: {hit[1].group(0)}"))
    lost = ev.select(facts.events, ev.NODE_LOST)
    if lost:
        e = lost[-1]
        causes.append(Cause("node_failure", f"node failure: {e.get('node')} lost ({e.get('state')}, reason: "
                            f"{e.get('reason')}); SLURM requeued the job off it (restart {e.get('restart_count')})",
                            [f"{x.get('node')}: {x.get('state')} ({x.get('reason')})" for x in lost]))
    elif state == "NODE_FAIL" or _grep(facts.logs, re.compile(r"NODE_FAIL|DUE TO NODE FAILURE")):
        # SLURM's own lines name the node: slurmstepd's "*** STEP 6.0 ON n1 CANCELLED AT ... DUE TO NODE
        # FAILURE" and srun's "Node failure on n1".
        hit = _grep(facts.logs, _FAILED_NODE)
        node = (hit[1].group(1) or hit[1].group(2)) if hit else None
        causes.append(Cause("node_failure", f"node failure: {node or 'a node of the job'} lost (SLURM NODE_FAIL)",
                            [f"{hit[0]}: {hit[1].group(0)}"] if hit else []))
    if state == "TIMEOUT" or _grep(facts.logs, re.compile(r"DUE TO TIME LIMIT")):
        causes.append(Cause("time_limit", "time limit reached (SLURM TIMEOUT)"))
    drain = story.preemption(now_events, state)
    if drain and not any(c.kind == "time_limit" for c in causes):
        causes.append(Cause("preempted", *drain))
    elif state == "PREEMPTED" or _grep(facts.logs, re.compile(r"DUE TO PREEMPTION")):
        causes.append(Cause("preempted", "preempted by SLURM"))
    srun = _unexplained_srun_death(facts)
    if srun and not crashed and not {"node_failure", "time_limit", "preempted"} & {c.kind for c in causes}:
        # SLURM kills every task at a time limit, preemption or node failure too: only a death of its own counts.
        name, m = srun
        causes.append(Cause("rank_crash", f"trainer rank crash: srun says task {m.group(2)} on {m.group(1)}: "
                            f"{m.group(3)} ({name})", _tail_lines(facts.logs, name)))
    failed = ev.select(now_events, ev.PHASE_FAILED)
    if failed:
        e = failed[0]  # the first failure is the cause; later ones are usually its echo on other ranks
        causes.append(Cause("exception", f"Python exception in {e.get('role')}-{e.get('rank')} during phase "
                            f"{e.get('phase')} step {e.get('step')}: {e.get('error')}",
                            [str(e.get("traceback", "")).rstrip()]))
    elif not alive and not ev.select(now_events, *ev.FINISHED):
        # A traceback in the logs of a job whose current attempt finished is an earlier attempt's (logs are
        # appended across starts): a peer's gloo error when a rank was killed and restarted in the allocation.
        hit = _grep(facts.logs, _TRACEBACK)
        if hit:
            causes.append(Cause("exception", f"Python exception ({hit[0]}): {hit[1].group(0).splitlines()[-1]}",
                                [hit[1].group(0)]))
    # The kit's own failures name a job that is otherwise fine (still running, or nothing else found)
    # before it is called running.
    ops = ops_causes(now_events) + damaged_checkpoints(facts.events)
    causes += ops
    exited = [hb for hb in facts.heartbeats if hb.get("state") == "exited"]
    clean = f" ({len(exited)} processes exited cleanly)" if exited else ""
    # COMPLETED without a `done` after a drain is a job that stopped early (its exit 0 is submitit's): not finished.
    if ev.select(now_events, *ev.FINISHED) or (state == "COMPLETED" and not ev.select(now_events, ev.DRAINED)):
        # One rule for every finished job: its headline is "finished", and every fault it met and survived
        # (a restarted rank, a readmitted engine, an unwritable heartbeat, a process that outlived it) is
        # evidence under it, never the headline.
        survived = [f"survived {c.kind}: {c.headline}" for c in causes]
        survived += [f"{label(hb)} (pid {hb.get('pid')} on {hb.get('host')}) still runs after the job finished, in "
                     f"{hb.get('phase')}" for hb in alive]
        headline = "finished OK" + clean + (f"; it survived {len(causes)} fault(s), listed below" if causes else "")
        causes = [Cause("finished", headline, survived)]
    elif alive and len(causes) == len(ops):
        steps = sorted({hb.get("step") for hb in alive if hb.get("step") is not None})
        phases = ", ".join(f"{label(hb)} in {hb.get('phase')}" for hb in alive)
        causes.append(Cause("running", f"still running (step {steps[-1] if steps else '?'}; {phases})"))
    elif not causes and exited and len(exited) == len(facts.heartbeats):
        causes.append(Cause("finished", "finished OK" + clean))  # off SLURM: every process said it exited
    if not causes:
        causes.append(Cause("unknown", f"no cause found (SLURM state {state or 'unknown'}); read the log tails"))
    for e in ev.select(now_events, ev.ENGINE_DIED, ev.ENGINE_UNHEALTHY):
        if causes[0].kind not in ("engine_crash", "engine_hang"):  # replaced in the allocation: the job went on
            causes[0].evidence.append(f"engine {e.get('engine')} {_verdict(e)}; replaced by its supervisor")
    # Every engine, once one met a fault (the one that served on too), and the reward service's restarts and its
    # workers' deaths: what the job went through is said under whatever its headline is.
    causes[0].evidence += story.engine_lines(now_events, facts.heartbeats) + story.reward_lines(now_events)
    for e in ev.select(facts.events, ev.TRAINER_RESTARTED, ev.TRAINER_RESTARTS_SPENT):
        what = (f"restarted in the allocation (restart {e.get('trainer_restart')} of {e.get('max_restarts')})"
                if ev.TRAINER_RESTARTED.matches(e)
                else f"not restarted: {e.get('reason')}; requeue: {e.get('requeue')}")
        causes[0].evidence.append(f"trainer rank crash: rank {e.get('dead_rank')} on {e.get('node')} died "
                                  f"({e.get('cause')}), {what}")
    for e in ev.select(earlier, ev.HANG_DETECTED, ev.PHASE_FAILED, ev.ENGINE_FAILED, ev.SYNC_VERIFY_FAILED,
                       ev.REWARD_SERVICE_DOWN, ev.DRAINED):
        causes[0].evidence.append(story.earlier_line(e))
    return causes


def _verdict(e: dict) -> str:
    """What an engine's supervisor found: died (exit code) or hung (its health-check verdict)."""
    where = f"on {e.get('node')}, pid {e.get('pid')}"
    if ev.ENGINE_UNHEALTHY.matches(e):
        return f"hung ({where}, process state {e.get('process_state')}): {e.get('cause')}"
    return f"died ({where}, exit code {e.get('exit_code')})"


def engine_causes(now_events: list[dict], logs: dict[str, str]) -> list[Cause]:
    """A rollout engine that failed the job, as a crash or a hang: from its supervisor's verdicts
    (engine_died / engine_unhealthy, rlslurm/rollout/supervisor.py) when there are any, its giving up past
    rollout.max_restarts (engine_down), the controller's engine_failed, else an engine's log."""
    verdicts = ev.select(now_events, ev.ENGINE_DIED, ev.ENGINE_UNHEALTHY)
    down = ev.select(now_events, ev.ENGINE_DOWN)
    failed = ev.select(now_events, ev.ENGINE_FAILED)
    if down and failed:  # an engine down while others served on is no cause: story.engine_lines tells it
        e = down[-1]
        last = [v for v in verdicts if v.get("engine") == e.get("engine")][-1:]
        kind = "engine_hang" if last and ev.ENGINE_UNHEALTHY.matches(last[0]) else "engine_crash"
        said = _verdict(last[0]) if last else e.get("reason")
        what = "hang" if kind == "engine_hang" else "crash"
        return [Cause(kind, f"rollout engine {what}: engine {e.get('engine')} on {e.get('node')} down past "
                      f"rollout.max_restarts = {e.get('max_restarts')} ({e.get('restarts')} replacements); "
                      f"last: {said}", [f"engine log: {e.get('log')}"])]
    if failed:
        e = failed[0]
        hung = [v for v in verdicts if ev.ENGINE_UNHEALTHY.matches(v) and v.get("url") == e.get("url")
                and float(v.get("t") or 0) <= float(e.get("t") or 0)]
        if hung:  # its supervisor killed it for hanging; that is what the controller's call then met
            v = hung[-1]
            return [Cause("engine_hang", f"rollout engine hang: {e.get('url')} (engine {v.get('engine')}, node "
                          f"{v.get('node')}, pid {v.get('pid')}, process state {v.get('process_state')}): "
                          f"{v.get('cause')}; killed by its supervisor, then: {e.get('cause')}",
                          [f"engine log: {v.get('log')}"] if v.get("log") else [])]
        where = ", ".join(f"{k.replace('_', ' ')} {e[k]}" for k in ("node", "pid", "exit_code")
                          if e.get(k) is not None)
        return [Cause("engine_crash", f"rollout engine crash: {e.get('url')}{f' ({where})' if where else ''}: "
                      f"{e.get('cause')}", [f"engine log: {e['log']}"] if e.get("log") else [])]
    hit = _grep({n: before_stop(t) for n, t in logs.items()}, _ENGINE, lambda n: "rollout" in n or "engine" in n)
    if hit:
        return [Cause("engine_crash", f"rollout engine crash: {hit[0]}: {hit[1].group(0)}")]
    return []


def ops_causes(now_events: list[dict]) -> list[Cause]:
    """The ops kit's own failures in this attempt: a heartbeat that still cannot be written (no
    `heartbeat_restored` after its `heartbeat_unwritable`), a node agent that died."""
    causes = [Cause("heartbeat_unwritable", f"heartbeat cannot be written: {e.get('role')}-{e.get('rank')} (pid "
                    f"{e.get('pid')} on {e.get('host')}): {e.get('error')} ({e.get('path')}); the node agent stopped "
                    f"judging it by heartbeat age, no hang was called on it", [str(e)])
              for e in still_unwritable(now_events)]
    for e in ev.select(now_events, ev.NODE_AGENT_DIED):
        then = "restarted" if e.get("restarted") else "not restarted (budget spent): its node's hangs went unwatched"
        causes.append(Cause("agent_died", f"node agent died: pid {e.get('agent_pid')} on {e.get('node')} "
                            f"{e.get('cause')}; {then}",
                            [f"agent log: {e.get('log')}"] + str(e.get("log_tail") or "").splitlines()))
    return causes


_SRUN_TASK_DIED = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (Killed|Segmentation fault|Bus error|Aborted)")


def _unexplained_srun_death(facts: Facts):
    """The first `task N: Killed`-like line of srun in the logs that no trainer supervisor event accounts for
    (rlslurm/slurm/supervisor.py names each rank death it restarted, or requeued for, by node and rank): a
    rank that was restarted in the allocation is the evidence of a job that went on, not its cause."""
    said = [(e.get("node"), str(e.get("dead_rank")))
            for e in ev.select(facts.events, ev.TRAINER_RESTARTED, ev.TRAINER_RESTARTS_SPENT)]
    for name, text in sorted(facts.logs.items()):
        for m in _SRUN_TASK_DIED.finditer(text):
            if (m.group(1), m.group(2)) in said:
                said.remove((m.group(1), m.group(2)))  # one event accounts for one report
                continue
            return name, m
    return None


def rank_crashes(facts: Facts, now_events: list[dict], alive: list[dict]) -> Cause | None:
    """A trainer rank that died without a word (SIGKILL, a segfault, the kernel's OOM killer) while another
    rank of the job outlived it: its heartbeat still says `running` but its process is gone (on this host;
    on another host srun's "task N: Killed" line is read later, after SLURM's own kills). Its peers then fail
    in a collective or hang: the symptom, named after.
    When every rank died that way nothing outlived them to go on (`unknown`)."""
    train = [hb for hb in facts.heartbeats if hb.get("role") == "train"]
    died = [e for e in ev.select(now_events, ev.RANK_DIED) if not e.get("oom_killed")]
    if died and len(died) < len(train):  # the node agent saw it die (diag/deaths.py): named from any host
        e = died[0]
        return Cause("rank_crash", f"trainer rank crash: {label(e)} (pid {e.get('rank_pid')} on {e.get('host')}) "
                     f"died {when(e)} without a Python exception or a clean "
                     f"exit (a signal: SIGKILL or a segfault; the OOM killer counted no kill)",
                     _symptoms(facts, now_events, alive))
    dead = [hb for hb in train if hb.get("state") == "running" and hb.get("host") == facts.host
            and not facts.pid_alive(hb)]
    if dead and len(dead) < len(train):
        first = min(dead, key=lambda hb: float(hb.get("t") or hb.get("last_progress") or 0))
        others = _symptoms(facts, now_events, alive)
        return Cause("rank_crash", f"trainer rank crash: {label(first)} (pid {first.get('pid')} on "
                     f"{first.get('host')}) died {when(first)} without a "
                     f"Python exception or a clean exit (a signal: SIGKILL, a segfault or the kernel's OOM killer)",
                     others)
    return None


def when(e: dict) -> str:
    """Where in its run a rank was, in words: 'in phase train step 4', or before its first phase began (a rank
    killed while it started has a heartbeat or event with neither)."""
    if e.get("phase") is None and e.get("step") is None:
        return "while it started (before its first phase)"
    step = f" step {e.get('step')}" if e.get("step") is not None else ""
    return f"in phase {e.get('phase')}{step}"


def oom_evidence(e: dict) -> str:
    """The kernel's record of an OOM kill in a `rank_died` event, in words."""
    def mib(n):
        return f"{n / 2**20:,.0f} MiB" if isinstance(n, int) and n < 2**62 else "none"

    if e.get("cgroup_oom_kills"):
        return (f"memory cgroup {e.get('cgroup')}: oom_kill +{e['cgroup_oom_kills']}, limit "
                f"{mib(e.get('memory_limit_bytes'))}, peak {mib(e.get('memory_peak_bytes'))}")
    return f"the node's oom_kill count +{e.get('node_oom_kills')}; no memory cgroup counter to read"


def _symptoms(facts: Facts, now_events: list[dict], alive: list[dict]) -> list[str]:
    """What the other ranks did after one died: the symptoms, listed under the cause."""
    others = [f"{e.get('role')}-{e.get('rank')} then failed in phase {e.get('phase')}: {e.get('error')}"
              for e in ev.select(now_events, ev.PHASE_FAILED)]
    others += [f"{label(hb)} then ended {hb.get('state')} at step {hb.get('step')}" for hb in facts.heartbeats
               if hb.get("state") in ("failed", "exited")]
    return others + [f"{label(hb)} still runs, in {hb.get('phase')}" for hb in alive]


def damaged_checkpoints(events: list[dict]) -> list[Cause]:
    """Checkpoints the last start skipped as damaged (complete-looking, failing their manifest): it resumed
    from an older one and made those steps again. Its `checkpoint_skipped` events come just before its
    `start`/`resume` event, so they are read from the attempt before the cut too."""
    starts = [i for i, e in enumerate(events) if ev.kind_of(e) in (ev.START, ev.RESUME)]
    if not starts:
        return []
    begin = starts[-2] + 1 if len(starts) > 1 else 0
    start = events[starts[-1]]
    frm = (f"resumed from {start.get('checkpoint')} (step {start.get('step')})" if ev.kind_of(start) == ev.RESUME
           else "started from scratch (no intact checkpoint left)")
    return [Cause("checkpoint_damaged", f"damaged checkpoint skipped: {e.get('checkpoint')} ({e.get('reason')}), "
                  f"kept aside as {e.get('moved_to')}; {frm}", [str(e)])
            for e in ev.select(events[begin:starts[-1]], ev.CHECKPOINT_SKIPPED) if "moved_to" in e]


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

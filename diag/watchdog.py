"""The node agent: one watchdog process per node that turns a silent hang into a dumped, named, acted-on event.

    python -m rlslurm.diag.watchdog --run-dir RUN [--job-id J] [--policy requeue|fail|dump] [--host H]
                                    [--parent-pid P]

Run it beside the ranks of a node (e.g. `srun --ntasks-per-node=1 ... &` in the batch script, or as a
subprocess of local rank 0). It is a separate process on purpose: a rank wedged in C code (an NCCL/gloo
wait) or holding the GIL cannot watch itself, and a thread inside it would share its fate.

Lifecycle: start -> every `diag.watch_interval_s` read <run>/heartbeats/*.json of this host whose
process is alive -> a rank is hung when now - last_progress > the phase timeout in its heartbeat ->
dump the stacks of every watched rank on this node into <run>/stacks/<stamp>/<host>-<role>-<rank>.txt
(diag/stack_dump.py), emit `hang_detected` naming the stuck ranks, their phases, the collective the
others wait in (a rank found in a collective counts as waiting even before its own timeout ran out: it
entered the collective a moment after the stuck rank stopped; a stopped process, state T, counts as stuck
whatever its stack shows: SIGSTOP may catch it inside the collective), then act by `diag.hang_policy`
(a rank whose heartbeat cannot be written, its `heartbeat_unwritable` event, is never judged hung by age:
`_mark_unwritable` says why):

- dump: nothing more; keep watching (the same hang is not reported twice).
- requeue: write <run>/control/drain (the drain gate of every process reads it), `scontrol requeue` the
  job (an injectable function), SIGTERM the wedged ranks (stuck and waiting), SIGKILL them after
  `diag.kill_grace_s`, and exit with ExitCode.HANG_DETECTED (76). The drain file stays behind (the wedged ranks die
  before they could remove it); a drain gate ignores a request older than its own process
  (diag/drain_gate.py), so the requeued start runs on.
- fail: the same without drain and requeue.

Deaths: a trainer rank whose process is gone while its heartbeat still says `running` (the OOM killer, a
segfault, a SIGKILL) is a `rank_died` event with the kernel's OOM-kill evidence (diag/deaths.py).

Stop: the agent must never outlive its job, and nothing else ends it where the rank that started it was
SIGKILLed (it runs in its own session, out of the reach of SLURM's process tracking). Each poll it exits
0, with a log line saying why, when
- every watched process of its node has exited (after it saw at least one),
- its parent (`--parent-pid`, by default the process that started it: the node's local rank 0) is gone,
- no running heartbeat of its node appeared within `diag.agent_idle_exit_s` of its start,
- or on SIGTERM/SIGINT.

Exit codes of this process: 0 in those cases, rlslurm.lifecycle's ExitCode.HANG_DETECTED (76) after
acting on a hang. The killed ranks themselves end by signal (143
after SIGTERM, 137 after SIGKILL in a shell's terms); the `hang_action` event records which pids got
which signal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from rlslurm.diag import collectives, nvidia_smi
from rlslurm.diag.collectives import Attribution, RankRecord, attribute, fetch
from rlslurm.diag.config import DiagConfig
from rlslurm.diag.deaths import DeathWatch
from rlslurm.diag.drain_gate import request_drain
from rlslurm.diag.heartbeat import label, pid_alive, process_started, read_heartbeats, still_unwritable
from rlslurm.diag.stack_dump import StackDump, collective_in, dump_stack, process_state, top_frame
from rlslurm.diag.suspend import SuspendWatch, slurm_job_state
from rlslurm.events import HANG_ACTION, HANG_DETECTED, emit
from rlslurm.lifecycle import ExitCode, requeue_job
from rlslurm.lifetime import StopFlag
from rlslurm.node import node_name
from rlslurm.rundir import RunDir

log = logging.getLogger("rlslurm.watchdog")

_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


@dataclass
class Rank:
    """One watched process as the watchdog sees it at one poll."""

    hb: dict
    age_s: float
    timeout_s: float
    dump: StackDump | None = None
    stack_file: Path | None = None
    state: str | None = None
    """psutil's process status, read for every rank at one moment before any dump."""
    records: str | None = None
    """How reading its flight recorder went ("flight recorder", or why not)."""
    unwritable: str | None = None
    """Why its heartbeat cannot be written (its `heartbeat_unwritable` event), if it cannot: then it is not hung."""

    @property
    def hung(self) -> bool:
        return self.age_s > self.timeout_s and self.unwritable is None

    @property
    def name(self) -> str:
        return label(self.hb)

    def where(self) -> str:
        """`train step 41`, or `between phases after step 41` (a step boundary's collective, say)."""
        phase, step = self.hb.get("phase"), self.hb.get("step")
        return f"{phase} step {step}" if phase else f"between phases after step {step}"


@dataclass
class HangReport:
    hung: list[Rank]
    watched: list[Rank]
    stacks_dir: Path
    message: str
    waiting: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)
    collective: str | None = None
    attribution: Attribution | None = None


class Watchdog:
    """Reads heartbeats of this host, detects hangs, dumps stacks, acts per policy. See the module docstring."""

    def __init__(self, run: RunDir, config: DiagConfig, *, host: str | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], object] | None = None,
                 requeue: Callable[[str], object] = requeue_job,
                 kill: Callable[[int, int], None] = os.kill, dump: Callable[..., StackDump] = dump_stack,
                 job_id: str | None = None, parent_pid: int | None = None,
                 state: Callable[[int], str] = process_state,
                 job_state: Callable[[], str | None] = slurm_job_state):
        self.run, self.config = run, config
        self.state = state
        self.host = host or node_name()
        self.clock, self.requeue, self.kill, self.dump = clock, requeue, kill, dump
        self.job_id = job_id
        self.parent_pid = parent_pid
        self._parent_started = process_started(parent_pid) if parent_pid else None
        # Set by SIGTERM's handler, so a flag, not an Event (StopFlag says why); waits end within its poll.
        self._stop = StopFlag()
        self.sleep = sleep or self._stop.wait
        # The kill grace is not cut short by stop(): SLURM's SIGTERM (the requeue just asked for) arrives
        # right then, and a stop-Event wait would turn the grace into a busy loop on a shared node.
        self._grace_sleep = sleep or threading.Event().wait
        self._reported: set[tuple] = set()
        self._unjudged: set[str] = set()
        self.reports: list[HangReport] = []
        self.deaths = DeathWatch(run)
        self.suspend = SuspendWatch(run, host=self.host, job_state=job_state, clock=clock)  # scontrol suspend

    def stop(self) -> None:
        self._stop.set()

    def watched(self) -> list[Rank]:
        """Running processes of this host with a heartbeat, with their age against their phase timeout."""
        now = self.clock()
        ranks = []
        for hb in read_heartbeats(self.run):
            if hb.get("host") != self.host or hb.get("state") != "running" or not pid_alive(hb):
                continue
            timeout = float(hb.get("phase_timeout_s") or self.config.timeout_for(hb.get("phase")))
            since = max(float(hb.get("last_progress") or now), self.suspend.resumed_at)  # no age while suspended
            ranks.append(Rank(hb, now - since, timeout))
        if any(r.age_s > r.timeout_s for r in ranks):
            self._mark_unwritable(ranks)
        return ranks

    def _mark_unwritable(self, ranks: list[Rank]) -> None:
        """Set `unwritable` on the ranks whose heartbeat could not be written since its last write.

        Such a rank is not judged by heartbeat age: its file ages because the disk refuses it, not because
        the rank stopped, and a hang reported on it would requeue the job into a restart that meets the
        same directory (a false hang, then a restart that fails the same way). Its process is still
        watched (alive or gone), a real hang of it still ends in its collectives' and phases' own
        timeouts, and once a write succeeds (a `written` newer than the event) it is judged again.
        Where not even the event could be written (a disk full under the whole run directory) the agent
        cannot tell, and judges it as before."""
        from rlslurm.events import read_events

        latest = {(e.get("host"), e.get("role"), e.get("rank"), e.get("pid")): e
                  for e in still_unwritable(read_events(self.run))}
        for r in ranks:
            e = latest.get((r.hb.get("host"), r.hb.get("role"), r.hb.get("rank"), r.hb.get("pid")))
            if e is not None and float(e.get("t") or 0) >= float(r.hb.get("written") or 0):
                r.unwritable = str(e.get("error"))
                if r.name not in self._unjudged:
                    self._unjudged.add(r.name)
                    log.warning("not judging %s by heartbeat age (%.1f s > %g s): its heartbeat cannot be "
                                "written (%s)", r.name, r.age_s, r.timeout_s, r.unwritable)
            else:
                self._unjudged.discard(r.name)

    def poll(self) -> HangReport | None:
        """One look at the heartbeats; on a hang not reported before: dump, report, act."""
        watched = self.watched()
        hung = [r for r in watched if r.hung]
        new = {(r.name, r.hb.get("pid"), r.hb.get("last_progress")) for r in hung}
        if not hung or new <= self._reported or self.suspend.holds(hung, self.state):
            return None
        self._reported |= new
        report = self.report(hung, watched)
        self.reports.append(report)
        self.act(report)
        return report

    def report(self, hung: list[Rank], watched: list[Rank]) -> HangReport:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.clock()))
        stacks_dir = self.run.stacks / stamp
        stacks_dir.mkdir(parents=True, exist_ok=True)
        # Every process state in one look, before any dump or record is taken: a stopped process (state T)
        # is the stuck one whatever its stack or records show (SIGSTOP may have caught it inside the
        # collective its peers now wait in), and two dumps taken moments apart cannot disagree about it.
        for r in watched:
            r.state = self.state(int(r.hb["pid"]))
        stopped = [r for r in watched if r.state in _STOPPED]
        records, notes, records_file = self._records(watched, stopped, stacks_dir)
        attribution = attribute(records)
        gpus = nvidia_smi.snapshot()  # None on a node without nvidia-smi
        if gpus is not None:
            (collectives.records_dir(self.run) / stacks_dir.name).mkdir(parents=True, exist_ok=True)
            (collectives.records_dir(self.run) / stacks_dir.name / f"{self.host}-nvidia-smi.txt").write_text(gpus)
        for r in watched:
            self._dump(r, stacks_dir)
            r.records = notes.get(r.name)
            if r.dump.state in _STOPPED and r not in stopped:  # stopped between the look and its dump
                r.state = r.dump.state
                stopped.append(r)
        # The records name the rank behind, or the one that took another collective, even where its stack
        # shows a collective too; any other rank in a collective (recorded in flight, or on its stack) waits
        # on them, even if its own timeout has a moment to go.
        blamed = set(attribution.ranks) if attribution else set()
        in_flight = {rec.name: last.op for rec in records if (last := rec.last()) is not None and not last.done}
        waiting = [r for r in watched if r not in stopped and r.name not in blamed
                   and (r.name in in_flight or collective_in(r.dump.text))]
        elsewhere = [r for r in watched if r in stopped or r.name in blamed or (r.hung and r not in waiting)]
        collective = next((c for r in waiting if (c := _collective(r, in_flight)) != "collective"),
                          next((_collective(r, in_flight) for r in waiting), None))
        message = _message(waiting, elsewhere)
        if attribution is not None:
            message += f"; collectives: {attribution.message}"
        report = HangReport(hung, watched, stacks_dir, message, [r.name for r in waiting],
                            [r.name for r in elsewhere], collective, attribution)
        extra = {"records": str(records_file)} if records_file else {}
        if attribution is not None:
            extra["attribution"] = attribution.to_json()
        emit(self.run, HANG_DETECTED, role="watchdog", rank=None, host=self.host,
             message=report.message, collective=collective, waiting=report.waiting,
             stuck=report.elsewhere, policy=self.config.hang_policy, stacks_dir=str(stacks_dir),
             ranks=[_rank_fields(r) for r in elsewhere + waiting], **extra)
        log.error("hang detected: %s (stacks in %s)", report.message, stacks_dir)
        return report

    def _records(self, watched: list[Rank], stopped: list[Rank],
                 stacks_dir: Path) -> tuple[list[RankRecord], dict[str, str], Path | None]:
        """Every rank's flight recorder: this node's, read now (a stopped rank cannot answer), and other nodes'
        as their agents wrote them for this hang (waited for a few polls at most: each agent sees the hang
        when its own ranks pass their timeout). Written to the stacks of this hang and for the other agents."""
        if self.config.collective_trace_entries <= 0:
            return [], {}, None
        timeout_s = min(5.0, self.config.stack_dump_timeout_s)
        notes = {r.name: "not read: process stopped (state T)" for r in stopped}
        live = [r for r in watched if r not in stopped]
        with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
            answers = list(pool.map(lambda r: fetch(self.run, r.hb, timeout_s), live))
        records = []
        for r, (record, how) in zip(live, answers):
            notes[r.name] = how
            if record is not None:
                records.append(record)
        folder = collectives.records_dir(self.run)
        mine = collectives.write(records, notes, folder / stacks_dir.name / f"{self.host}.json")
        shared = folder / f"latest-{self.host}.json"
        tmp = shared.with_name(f".{shared.name}.{os.getpid()}.tmp")
        tmp.write_bytes(mine.read_bytes())
        os.replace(tmp, shared)
        records += self._other_hosts(started=self.clock() - self.config.watch_interval_s * 4)
        return records, notes, mine

    def _other_hosts(self, started: float) -> list[RankRecord]:
        """Records other nodes' agents wrote since `started`, for every host with a running heartbeat."""
        hosts = {hb.get("host") for hb in read_heartbeats(self.run) if hb.get("state") == "running"} - {self.host}
        deadline = self.clock() + 2 * self.config.watch_interval_s + 1.0
        found: dict[str, list[RankRecord]] = {}
        while True:
            for host in sorted(hosts - set(found)):
                path = collectives.records_dir(self.run) / f"latest-{host}.json"
                with contextlib.suppress(OSError, ValueError, KeyError):
                    if path.stat().st_mtime >= started:
                        found[host] = collectives.read(path)
            if set(found) >= hosts or self.clock() >= deadline:
                break
            self._grace_sleep(0.1)
        if hosts - set(found):
            log.info("no collective records of %s for this hang (their agents have not seen it)",
                     ", ".join(sorted(hosts - set(found))))
        return [r for rs in found.values() for r in rs]

    def _dump(self, r: Rank, stacks_dir: Path) -> None:
        from rlslurm.diag.guard import faulthandler_path

        pid = int(r.hb["pid"])
        fh = faulthandler_path(self.run, r.hb["role"], r.hb["rank"], self.host)
        r.dump = self.dump(pid, native=self.config.native_stacks,
                           timeout_s=self.config.stack_dump_timeout_s, faulthandler_file=fh)
        stopped = r.state in _STOPPED or r.dump.state in _STOPPED
        state = "stopped (state T)" if stopped else (r.state or r.dump.state)
        # Say the collective in words: DDP's gradient all-reduce shows only as c10d::Reducer frames.
        coll = collective_in(r.dump.text)
        head = (f"# {r.name} pid {pid} on {self.host}: phase {r.hb.get('phase')}, step {r.hb.get('step')}, "
                f"no progress for {r.age_s:.1f} s (timeout {r.timeout_s:g} s), process {state}, "
                f"{f'waiting in {coll}, ' if coll else ''}dumped by {r.dump.method}\n")
        r.stack_file = stacks_dir / f"{self.host}-{r.hb['role']}-{r.hb['rank']}.txt"
        r.stack_file.write_text(head + r.dump.text)

    def act(self, report: HangReport) -> None:
        policy = self.config.hang_policy
        done: dict = {"policy": policy}
        if policy == "dump":
            emit(self.run, HANG_ACTION, role="watchdog", rank=None, action="dump", **done)
            return
        if policy == "requeue":
            done["drain_file"] = str(request_drain(self.run, f"hang detected: {report.message}"))
            job_id = self.job_id or next((r.hb.get("job_id") for r in report.hung if r.hb.get("job_id")), None)
            if job_id is None:
                done["requeue"] = "no SLURM job id: not requeued"
            else:
                try:
                    done["requeue"] = str(self.requeue(str(job_id)))
                except Exception as e:  # a failed requeue must not stop the kill: the job still has to end
                    done["requeue"] = f"failed: {e}"
        named = set(report.waiting) | set(report.elsewhere)
        wedged = report.hung + [r for r in report.watched if r.name in named and r not in report.hung]
        done["killed"] = self._kill(wedged)
        emit(self.run, HANG_ACTION, role="watchdog", rank=None, action=policy, **done)
        log.error("hang action %s: %s", policy, done)
        self.stop()

    def _kill(self, ranks: list[Rank]) -> dict[str, str]:
        """SIGTERM (+SIGCONT for stopped ones), wait up to kill_grace_s, SIGKILL the survivors."""
        result: dict[str, str] = {}
        for r in ranks:
            pid = int(r.hb["pid"])
            self.deaths.spared.add(pid)
            try:
                self.kill(pid, signal.SIGTERM)
                self.kill(pid, signal.SIGCONT)  # a stopped process only acts on SIGTERM once continued
                result[r.name] = f"pid {pid}: SIGTERM"
            except ProcessLookupError:
                result[r.name] = f"pid {pid}: already gone"
        deadline = self.clock() + self.config.kill_grace_s
        log.info("waiting up to %.1f s for %d wedged ranks to exit after SIGTERM",
                 self.config.kill_grace_s, len(ranks))
        while any(pid_alive(r.hb) for r in ranks) and self.clock() < deadline:
            self._grace_sleep(0.1)
        for r in ranks:
            if pid_alive(r.hb):
                try:
                    self.kill(int(r.hb["pid"]), signal.SIGKILL)
                    result[r.name] += ", SIGKILL"
                except ProcessLookupError:
                    pass
        return result

    def parent_gone(self) -> bool:
        """Whether the process this agent belongs to has exited (a pid reused since does not count)."""
        if not self.parent_pid:
            return False
        started = process_started(self.parent_pid)
        if started is None or self._parent_started is None:
            return True
        return abs(started - self._parent_started) > 1.0

    def watch(self, exit_when_idle: bool = True) -> int:
        """Poll until stopped; returns this process's exit code (see the module docstring)."""
        code = self._poll_until_done(exit_when_idle)
        # However the watch ends (a stop, the parent's exit, the last rank's): a rank can die within one poll of
        # its first heartbeat, so no look saw it alive (seen in CI: a capped rank OOM-killed 0.5 s after its first
        # beat, and the agent left on its dead parent without a word). One last look at the run's capped ranks
        # names it.
        self.deaths.look([r.hb for r in self.watched()], final=True)
        return code

    def _poll_until_done(self, exit_when_idle: bool) -> int:
        log.info("watching heartbeats of host %s in %s every %.2f s, policy %s, parent pid %s, idle exit "
                 "after %.0f s", self.host, self.run.path, self.config.watch_interval_s,
                 self.config.hang_policy, self.parent_pid, self.config.agent_idle_exit_s)
        seen = False
        started = self.clock()
        while not self._stop.is_set():
            watched = self.watched()
            # Before the exits below: the rank that just died may be the last one, or the agent's parent.
            self.deaths.look([r.hb for r in watched])
            seen = seen or bool(watched)
            if exit_when_idle and seen and not watched:
                log.info("exiting: every watched process on %s has exited", self.host)
                return 0
            if exit_when_idle and not seen and self.clock() - started > self.config.agent_idle_exit_s:
                log.info("exiting: no running heartbeat of %s appeared in %.0f s (diag.agent_idle_exit_s)",
                         self.host, self.config.agent_idle_exit_s)
                return 0
            if exit_when_idle and self.parent_gone():
                log.info("exiting: parent pid %s is gone (the job's process on %s ended)",
                         self.parent_pid, self.host)
                return 0
            if self.poll() is not None and self.config.hang_policy != "dump":
                return ExitCode.HANG_DETECTED
            slept = self.clock()
            self.sleep(self.config.watch_interval_s)
            self.suspend.unobserved(self.clock() - slept - self.config.watch_interval_s, self.watched,
                                    self.config.watch_interval_s)
        log.info("exiting: asked to stop (SIGTERM/SIGINT)")
        return 0


def _rank_fields(r: Rank) -> dict:
    return {"rank": r.name, "pid": r.hb.get("pid"), "host": r.hb.get("host"), "phase": r.hb.get("phase"),
            "step": r.hb.get("step"), "age_s": round(r.age_s, 2), "timeout_s": r.timeout_s,
            "state": r.state or (r.dump.state if r.dump else None),
            "collective": collective_in(r.dump.text) if r.dump else None, "records": r.records,
            "top_frame": top_frame(r.dump.text) if r.dump else None,
            "stack_file": str(r.stack_file) if r.stack_file else None}


def _collective(r: Rank, in_flight: dict[str, str]) -> str | None:
    """The collective a waiting rank is in: from its stack, else from its flight recorder's open entry."""
    found = collective_in(r.dump.text) if r.dump else None
    return found if found not in (None, "collective") else in_flight.get(r.name, found)


def _message(waiting: list[Rank], elsewhere: list[Rank]) -> str:
    """`1 rank in all_reduce of train step 41 (train-0), train-1 in the data phase step 41 (...): ...`."""
    parts = []
    groups: dict[tuple, list[Rank]] = {}
    for r in waiting:
        groups.setdefault((collective_in(r.dump.text) or "a collective", r.hb.get("phase"), r.hb.get("step")),
                          []).append(r)
    for (coll, phase, _step), rs in groups.items():
        n = f"{len(rs)} rank{'s' if len(rs) > 1 else ''}"
        where = f"of {rs[0].where()}" if phase else rs[0].where()
        parts.append(f"{n} in {coll} {where} ({', '.join(r.name for r in rs)})")
    for r in elsewhere:
        stopped = ", process stopped (state T)" if r.state in _STOPPED else ""
        at = top_frame(r.dump.text) if r.dump else None
        phase = r.hb.get("phase")
        where = f"in the {phase} phase step {r.hb.get('step')}" if phase else r.where()
        parts.append(f"{r.name} {where}{f' at {at}' if at else ''}{stopped}")
    ages = ", ".join(f"{r.name} {r.age_s:.1f} s {'>' if r.hung else 'of'} {r.timeout_s:g} s"
                     for r in waiting + elsewhere)
    text = ", ".join(parts) + f" (no progress: {ages})"
    if waiting and elsewhere:
        text += f": {', '.join(r.name for r in waiting)} wait{'s' if len(waiting) == 1 else ''} on " \
                f"{', '.join(r.name for r in elsewhere)}"
    return text


def _load_config(run: RunDir) -> DiagConfig:
    if not run.config.is_file():
        return DiagConfig()
    from rlslurm.configfile import load_mapping, read_yaml

    data = read_yaml(run.config) or {}
    return load_mapping(DiagConfig, data.get("diag"), source=str(run.config), key="diag")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlslurm.diag.watchdog", description=__doc__.split("\n")[0])
    env_run = os.environ.get("RLSLURM_RUN_DIR")
    p.add_argument("--run-dir", default=env_run, required=not env_run,
                   help="the run directory (default: $RLSLURM_RUN_DIR)")
    p.add_argument("--host", help="node name whose heartbeats to watch (default: SLURMD_NODENAME or hostname)")
    p.add_argument("--job-id", help="SLURM job id to requeue (default: the one in the heartbeats)")
    p.add_argument("--policy", choices=("requeue", "fail", "dump"), help="override diag.hang_policy")
    p.add_argument("--hang-timeout-s", type=float, help="override diag.hang_timeout_s")
    p.add_argument("--watch-interval-s", type=float, help="override diag.watch_interval_s")
    p.add_argument("--kill-grace-s", type=float, help="override diag.kill_grace_s")
    p.add_argument("--parent-pid", type=int,
                   help="exit once this process is gone (default: the process that started the agent; 0 = never)")
    p.add_argument("--once", action="store_true", help="poll once and exit (0, or 76 after acting on a hang)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s watchdog %(levelname)s %(message)s")
    run = RunDir(Path(args.run_dir))
    config = _load_config(run)
    overrides = {k: v for k, v in (("hang_policy", args.policy), ("hang_timeout_s", args.hang_timeout_s),
                                   ("watch_interval_s", args.watch_interval_s),
                                   ("kill_grace_s", args.kill_grace_s)) if v is not None}
    config = dataclasses.replace(config, **overrides)
    parent = os.getppid() if args.parent_pid is None else args.parent_pid
    dog = Watchdog(run, config, host=args.host, job_id=args.job_id, parent_pid=parent or None)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: dog.stop())
    if args.once:
        report = dog.poll()
        return ExitCode.HANG_DETECTED if report is not None and config.hang_policy != "dump" else 0
    return dog.watch()


if __name__ == "__main__":
    sys.exit(main())

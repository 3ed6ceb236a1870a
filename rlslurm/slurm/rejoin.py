"""Keep a het job's components together when SLURM requeues only some of them (a lost node).

    arm(run, leader="12", component_ids=["12", "13"])        # rank 0 of component 0, at every start
    <run>/rejoin.sh 12 /path/to/run 13                       # what SLURM runs when component 13 ends

Measured on the local Slurm (Debian's 22.05-24.11): a node of one component set DOWN mid-run requeues that
component (PENDING, Restarts+1) while SLURM ends the others (FAILED, reason JobLaunchFailure); the het job
then pends for good, since a component that ended never starts again. Nothing of the job runs any more to
notice, so the fix is SLURM's own: a `strigger --fini` on every component (run by slurmctld, as the job's
user, when that component ends). It finds the job split (one component pending, another ended by SLURM)
and requeues the whole het job through its leader, which brings the ended components back to PENDING; it
then asks SLURM to keep the requeued job off the nodes the last attempt lost (`scontrol update
ExcNodeList`, taken only from a pending job; recorded in <run>/excluded_nodes.json for `rlslurm status`).
At a normal end every component is COMPLETED (or the user cancelled them all) and the trigger does nothing.
A trigger fires once: every start arms them again.

The same trigger covers the batch script's own death (issue 28, case 2): `kill -9` of the trainer supervisor
(python -m rlslurm.slurm.supervisor, the batch step's process) ended every component FAILED 0.6 s later and
nothing requeued the job. Component 0 FAILED by a signal (ExitCode `0:N`) in a run without its `done` is
that death (a rank's exception is `1:0`, SLURM's own stops are TIMEOUT, CANCELLED, NODE_FAIL, PREEMPTED):
the trigger requeues the job (`batch_requeued`), which resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from rlslurm import events, lifecycle
from rlslurm.errors import SlurmCommandError
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.slurm import commands, parse

log = logging.getLogger(__name__)

EXCLUDED = "excluded_nodes.json"
"""<run>/excluded_nodes.json: the nodes a lost-node requeue asked SLURM to avoid (node, state, reason, when)."""
ENDED_BY_SLURM = ("FAILED", "NODE_FAIL", "COMPLETED", "BOOT_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE")
"""Final states of a component that SLURM (not the user: CANCELLED is left alone) ended beside a requeued one."""


def split(states: Sequence[dict[str, str]]) -> bool:
    """Whether a het job's components (`scontrol show job` records) are split: one requeued (PENDING or
    REQUEUED) while another ended without the user's cancel; that job never starts again by itself."""
    pending = [s for s in states if s.get("JobState") in ("PENDING", "REQUEUED", "REQUEUE_HOLD")]
    ended = [s for s in states if s.get("JobState") in ENDED_BY_SLURM]
    return bool(pending) and bool(ended)


SCRIPT = "rejoin.sh"
"""<run>/rejoin.sh: what the triggers run. slurmctld discards a trigger's output, and `python -m` started
straight from a trigger exited 1 before its first line ran (measured: the same command through a shell that
gives it files for its standard streams works): the script gives it those, and a log, logs/rejoin.log."""


def arm(run: RunDir, leader: str, component_ids: Sequence[str], python: str = sys.executable) -> list[str]:
    """A `--fini` trigger on every component of this start (earlier ones of ours cleared first); returns the
    components armed. Best effort: a site that refuses user triggers keeps SLURM's own behaviour, logged."""
    if any(c.isspace() for c in str(run.path)):
        log.warning("rejoin triggers not armed: strigger splits its program on spaces (%s)", run.path)
        return []
    script = run.path / SCRIPT
    script.write_text("#!/bin/sh\n# Written by rlslurm/slurm/rejoin.py: slurmctld runs it when a component of the job "
                      "ends (strigger --fini).\n"
                      f"exec {shlex.quote(python)} -m rlslurm.slurm.rejoin \"$@\" "
                      f">> {shlex.quote(str(run.logs / 'rejoin.log'))} 2>&1 < /dev/null\n")
    script.chmod(0o700)
    armed = []
    for job_id in component_ids:
        program = [str(script), str(leader), str(run.path)]  # SLURM appends the job id that ended
        try:
            commands.strigger_fini(job_id, program)
            armed.append(job_id)
        except SlurmCommandError as e:
            log.warning("rejoin trigger on component %s not armed: %s", job_id, e)
    return armed


def lost_nodes(run: RunDir, show_node=commands.show_node) -> list[dict]:
    """Nodes of the last attempt (placement.jsonl) that SLURM now holds DOWN, not responding or drained."""
    rows = read_jsonl(run.path / "placement.jsonl")
    last = max((r.get("restart_count", 0) for r in rows), default=0)
    nodes = {r["node"] for r in rows if r.get("restart_count", 0) == last and r.get("node")}
    return lifecycle.lost_nodes(nodes, last + 1, show_node)


@dataclass(frozen=True)
class Exclusion:
    """What to ask SLURM for one component of a requeued job."""

    job_id: str
    exclude: tuple[str, ...]
    """The component's whole ExcNodeList to set: its own exclusions, then the failed nodes added."""
    added: tuple[str, ...] = ()
    """The failed nodes of the component's partitions this adds."""
    why_not: str | None = None
    """Why a failed node of the component's partitions is not added (the job would never start again)."""


def exclusions(records: Sequence[Mapping[str, str]], nodes: Sequence[str],
               partition_nodes: Callable[[str], list[str]]) -> list[Exclusion]:
    """Pure: per component (`scontrol show job` records), the ExcNodeList that keeps it off the failed `nodes`
    of its partitions. A failed node the job pins (--nodelist), or one without which its partitions no longer
    hold the nodes the component needs, is not added: the job would pend for good."""
    plans = []
    for r in records:
        pool = [n for p in r.get("Partition", "").split(",") if p for n in partition_nodes(p)]
        have = parse.expand_nodelist(r.get("ExcNodeList", ""))
        new = [n for n in nodes if n in pool and n not in have]
        pinned = [n for n in new if n in parse.expand_nodelist(r.get("ReqNodeList", ""))]
        need = int((r.get("NumNodes") or "1").split("-")[0])
        left = [n for n in pool if n not in have and n not in new]
        why_not = None
        if pinned:
            why_not = f"component {r.get('JobId')} asks for {','.join(pinned)} by name (--nodelist)"
        elif new and len(left) < need:
            why_not = (f"partition {r.get('Partition')} would keep {len(left)} node(s) for the {need} that "
                       f"component {r.get('JobId')} needs")
        added = () if why_not else tuple(new)
        plans.append(Exclusion(r.get("JobId", ""), tuple(have) + added, added, why_not))
    return plans


def keep_off(run: RunDir, leader: str, nodes: Sequence[dict], *, show_job=commands.show_job,
             partition_nodes=commands.partition_nodes) -> list[str]:
    """Ask SLURM to keep the requeued job `leader` off `nodes` ({node, state, reason, restart_count}) by
    `scontrol update ExcNodeList` of its components, and record them in <run>/excluded_nodes.json (`rlslurm
    status` shows them, with SLURM's refusal or the reason not to ask). Returns the names SLURM took.

    Call it after the requeue: SLURM refuses the update of a running job ("Job is no longer pending
    execution") and takes it as soon as the requeue returns, before the requeue delay lets the job start
    again. Measured on 22.05 too: the update sets the list whole (the user's --exclude would be lost, so each
    component gets its own list back with the nodes added) and a leader's update is copied to every
    component (so the leader goes first, then every other component)."""
    if not nodes:
        return []
    names = [x["node"] for x in nodes]
    took: list[str] = []
    refused = None
    try:
        plans = exclusions(show_job(leader), names, partition_nodes)
    except (SlurmCommandError, parse.SlurmParseError) as e:
        plans, refused = [], (getattr(e, "stderr", "") or str(e)).strip()
    if any(p.added for p in plans):
        for plan in sorted(plans, key=lambda p: p.job_id != str(leader)):
            try:
                commands.scontrol("update", f"JobId={plan.job_id}", f"ExcNodeList={','.join(plan.exclude)}")
                took += plan.added
            except SlurmCommandError as e:
                log.warning("could not exclude %s from component %s: %s", plan.added, plan.job_id, e)
                refused = (getattr(e, "stderr", "") or str(e)).strip()
    why_not = "; ".join(p.why_not for p in plans if p.why_not)
    path = run.path / EXCLUDED
    previous = json.loads(path.read_text()) if path.is_file() else []
    now = []
    for x in nodes:
        kept = x["node"] in took
        now.append({**x, "t": time.time(), "excluded": kept,
                    **({} if kept else {"refused": refused} if refused else
                       {"not_asked": why_not or "not in the partitions of any component"})})
    path.write_text(json.dumps(previous + now, indent=1))
    return sorted(set(took))


def batch_killed(states: Sequence[Mapping[str, str]]) -> str | None:
    """Pure: why the job's batch script died by a signal (its component 0 FAILED with ExitCode `0:N`, N > 0;
    no component pending), or None."""
    lead = [s for s in states if s.get("HetJobOffset", "0") == "0"][:1] or list(states[:1])
    if not lead or any(s.get("JobState") in ("PENDING", "REQUEUED", "REQUEUE_HOLD") for s in states):
        return None
    _, _, sig = (lead[0].get("ExitCode") or "0:0").partition(":")
    if lead[0].get("JobState") != "FAILED" or sig in ("", "0"):
        return None
    return (f"component 0 of job {lead[0].get('JobId')} FAILED by signal {sig} (ExitCode {lead[0].get('ExitCode')}): "
            "its batch script, the trainer supervisor, was killed")


def finished(run: RunDir) -> bool:
    """Whether the run's newest start trained every step (its `done` after its last start/resume)."""
    seen = events.read_events(run)
    starts = [i for i, e in enumerate(seen) if events.kind_of(e) in (events.START, events.RESUME)]
    return any(events.kind_of(e) == events.DONE for e in seen[starts[-1] if starts else 0:])


def _first_to_act(run: RunDir, leader: str, states: Sequence[Mapping[str, str]]) -> bool:
    """Every component's trigger fires when SLURM ends them together, and each sees the same FAILED states:
    only the first (an exclusive marker per job and SLURM restart) requeues, or the second would requeue the
    job again once it runs (measured: two `batch_requeued` for one kill)."""
    marker = run.path / f".batch-requeued-{leader}-{states[0].get('Restarts', '0') if states else '0'}"
    try:
        marker.open("x").close()
        return True
    except FileExistsError:
        log.info("job %s: another trigger of this end requeued it already (%s)", leader, marker.name)
        return False


def rejoin(leader: str, run: RunDir, fired_by: str | None = None) -> str | None:
    """If the het job is split, keep it off the lost nodes and requeue it whole; if its batch script was killed
    before it finished, requeue it; what was done, or None."""
    states = commands.show_job(leader)
    if not split(states):
        why = batch_killed(states)
        if why and not finished(run) and _first_to_act(run, leader, states):
            done = commands.requeue(leader)
            events.emit(run, events.BATCH_REQUEUED, role="slurmctld", job_id=leader, fired_by=fired_by,
                        states={s.get("HetJobOffset", "0"): f"{s.get('JobState')} {s.get('ExitCode')}" for s in states},
                        reason=why, result=done)
            return done
        log.info("job %s not split (%s): nothing to do", leader, [s.get("JobState") for s in states])
        return None
    lost = lost_nodes(run)
    done = commands.requeue(leader)
    excluded = keep_off(run, leader, lost)  # after the requeue: SLURM takes ExcNodeList only from a pending job
    events.emit(run, events.COMPONENTS_REQUEUED, role="slurmctld", job_id=leader, fired_by=fired_by,
                states={s.get("HetJobOffset", "0"): s.get("JobState") for s in states},
                excluded=excluded, result=done)
    for x in lost:
        events.emit(run, events.NODE_LOST, role="slurmctld", **x)
    return done


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m rlslurm.slurm.rejoin LEADER_JOB_ID RUN_DIR [FIRED_BY_JOB_ID]", file=sys.stderr)
        return 2
    run = RunDir(Path(args[1]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rejoin %(levelname)s %(message)s")  # to rejoin.sh's log
    log.info("fired: %s", shlex.join(args))
    try:
        log.info("%s", rejoin(args[0], run, args[2] if len(args) > 2 else None))
    except Exception:  # noqa: BLE001 - slurmctld discards a trigger's exit: the log is all there is
        log.exception("rejoin of job %s failed", args[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

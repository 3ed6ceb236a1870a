"""Keep a het job's components together when SLURM requeues only some of them (a lost node).

    arm(run, leader="12", component_ids=["12", "13"])        # rank 0 of component 0, at every start
    <run>/rejoin.sh 12 /path/to/run 13                       # what SLURM runs when component 13 ends

Measured on the local Slurm (Debian's 22.05-24.11): a node of one component set DOWN mid-run requeues that
component (PENDING, Restarts+1) while SLURM ends the others (FAILED, reason JobLaunchFailure); the het job
then pends for good, since a component that ended never starts again. Nothing of the job runs any more to
notice, so the fix is SLURM's own: a `strigger --fini` on every component (run by slurmctld, as the job's
user, when that component ends). It finds the job split (one component pending, another ended by SLURM)
and requeues the whole het job through its leader, which brings the ended components back to PENDING; it
first asks SLURM to keep the requeued job off the nodes the last attempt lost (`scontrol update
ExcNodeList`, recorded in <run>/excluded_nodes.json for `rlslurm status`). At a normal end every component
is COMPLETED (or the user cancelled them all) and the trigger does nothing. A trigger fires once: every
start arms them again.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

from rlslurm import events, lifecycle
from rlslurm.errors import SlurmCommandError
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.slurm import commands

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


def keep_off(run: RunDir, job_ids: Sequence[str], nodes: Sequence[dict]) -> list[str]:
    """Ask SLURM to keep the job's components `job_ids` off `nodes` ({node, state, reason, restart_count}):
    `scontrol update ExcNodeList`, and record them in <run>/excluded_nodes.json (`rlslurm status` shows them,
    with SLURM's refusal where it refused: measured on 22.05, it refuses a running job, "Job is no longer
    pending execution"). Returns the names asked for."""
    if not nodes:
        return []
    names = ",".join(x["node"] for x in nodes)
    refused, accepted = None, False
    for job_id in job_ids:
        try:  # a component SLURM refuses to update (already ended) is requeued anyway: still worth it
            commands.scontrol("update", f"JobId={job_id}", f"ExcNodeList={names}")
            accepted = True
        except SlurmCommandError as e:
            log.warning("could not exclude %s from component %s: %s", names, job_id, e)
            refused = (getattr(e, "stderr", "") or str(e)).strip()
    refused = None if accepted else refused  # one component that takes it keeps the requeued job off them
    path = run.path / EXCLUDED
    before = json.loads(path.read_text()) if path.is_file() else []
    now = [{**x, "t": time.time(), **({"refused": refused} if refused else {})} for x in nodes]
    path.write_text(json.dumps(before + now, indent=1))
    return [x["node"] for x in nodes]


def rejoin(leader: str, run: RunDir, fired_by: str | None = None) -> str | None:
    """If the het job is split, keep it off the lost nodes and requeue it whole; what was done, or None."""
    states = commands.show_job(leader)
    if not split(states):
        log.info("job %s not split (%s): nothing to do", leader, [s.get("JobState") for s in states])
        return None
    lost = lost_nodes(run)
    keep_off(run, [s["JobId"] for s in states], lost)
    done = commands.requeue(leader)
    events.emit(run, events.COMPONENTS_REQUEUED, role="slurmctld", job_id=leader, fired_by=fired_by,
                states={s.get("HetJobOffset", "0"): s.get("JobState") for s in states},
                excluded=[x["node"] for x in lost], result=done)
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

"""Helpers of tests/cluster/test_spine.py: write a toy job's YAML, submit it through `rlslurm.launch`, wait
on the run directory and SLURM (bounded, polled, logged), and read back losses, checksums and events.

Every number a test asserts comes from the run directory the job wrote (events.jsonl, metrics.jsonl,
placement.jsonl, checkpoints/) or from SLURM itself (scontrol / squeue through rlslurm.slurm.commands).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Callable

import yaml

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.events import read_events
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.slurm import commands, hetjob
from waiting import wait_for

log = logging.getLogger("tests.cluster.spine")

STEPS = 24
"""Steps of every toy run here: same seed, lr, batch and world size, so the same final weights."""
INTERVAL = 4
"""checkpoint.interval_steps of the runs (the SIGKILL test uses 2 x INTERVAL)."""
KILL_WAIT_S = 5
"""The local cluster's KillWait (rlslurm/slurm/localcluster.py); checkpoint.kill_wait_s matches it."""
CRED_EXPIRE_S = 5
"""The local cluster's munge cred_expire: the fixed part of SLURM's requeue delay."""


def toy_config(path: Path, run_root: Path, *, step_delay_s: float = 0.2, interval_steps: int = INTERVAL,
               time_limit_min: int = 5, signal_before_s: int = 30, backend: str = "slurm",
               max_restarts: int | None = None) -> Path:
    """Write the toy job's YAML: a het job of 1 train node (2 ranks) + 1 rollout node (the stand-in)."""
    data = {
        "job": {"name": path.stem, "kind": "toy"},
        "hardware": {"profile": "cpu", "nodes": 2, "gpus_per_node": 2},
        "placement": {"mode": "separate", "rollout_nodes": 1},
        "train": {"steps": STEPS, "step_delay_s": step_delay_s,
                  **({} if max_restarts is None else {"max_restarts": max_restarts})},
        # cost_s: the default (490 s, the lecture's) is longer than these allocations, so the policy would
        # save after step 1 and shift the grid of periodic checkpoints the tests reason about.
        "checkpoint": {"interval_steps": interval_steps, "kill_wait_s": KILL_WAIT_S, "cost_s": 0.5},
        "cluster": {"backend": backend, "time_limit_min": time_limit_min, "signal_before_s": signal_before_s,
                    "run_root": str(run_root)},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


TRACKED: list[tuple[str, Path]] = []
"""(SLURM job id, run dir) of every job these tests submitted, for `cleanup`."""


def submit(config: Path) -> launch.Submission:
    """`rlslurm submit CONFIG` as a library call."""
    job = load_config(config)
    sub = launch.submit(job, config_text=config.read_text())
    log.info("submitted %s job %s: %s", sub.backend, sub.job_id, sub.run_dir)
    if sub.backend == "slurm":
        TRACKED.append((sub.job_id, sub.run_dir))
    return sub


def cleanup(timeout_s: float = 30.0) -> list[str]:
    """Cancel the tracked jobs still in SLURM and end what their runs left behind; returns what it did.

    The local cluster's daemons stop at the end of the session, but a job's processes do not stop with
    them (slurmstepd lives on): a job left running held its rendezvous port into the next session, whose
    job of the same id wanted it. A rank killed by SIGKILL also orphans its node agent (a new session,
    reparented to init, out of proctrack/linuxproc's reach). Processes are found by their run directory.
    """
    import psutil

    done = []
    live = [job_id for job_id, _ in TRACKED if state(job_id) in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING")]
    for job_id in live:
        commands.scancel(job_id)
        done.append(f"scancel {job_id}")
    if live:
        wait_for(f"jobs {live} to leave SLURM", lambda: all(state(j) not in ("PENDING", "RUNNING", "COMPLETING")
                                                             for j in live), timeout_s, poll_s=0.5)
    runs = [str(run) for _, run in TRACKED]
    leftovers = [p for p in psutil.process_iter(["pid", "cmdline"])
                 if p.info["cmdline"] and any(r in arg for arg in p.info["cmdline"] for r in runs)]
    for proc in leftovers:
        log.warning("ending leftover pid %d: %s", proc.pid, " ".join(proc.info["cmdline"]))
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
            done.append(f"terminate {proc.pid} ({' '.join(proc.info['cmdline'][1:4])})")
    _, alive = psutil.wait_procs(leftovers, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    TRACKED.clear()
    return done


def leftovers(run: Path) -> list[str]:
    """This machine's live processes whose command line names the run directory: after the job ended, none
    may be left (a killed parent's children included)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
        if p.info["cmdline"] and p.info["status"] != psutil.STATUS_ZOMBIE and \
                any(str(run) in arg for arg in p.info["cmdline"]):
            out.append(f"pid {p.info['pid']} (parent {p.info['ppid']}): {' '.join(p.info['cmdline'])}")
    return out


def state(job_id: str) -> str | None:
    """SLURM state of component 0 of the het job (RUNNING, PENDING, COMPLETED, ...)."""
    return hetjob.job_states([job_id]).get(job_id, {}).get("State")


def events(run: Path, kind: str | None = None) -> list[dict]:
    return read_events(RunDir(run), kind)


def wait_done(job_id: str, run: Path, timeout_s: float, kick: Callable[[], None]) -> float:
    """Until the run's `done` event and SLURM's COMPLETED, kicking the idle scheduler for requeued jobs."""
    started = time.monotonic()
    wait_for(f"job {job_id} ({run.name}) to finish", lambda: events(run, "done"), timeout_s, on_poll=kick, poll_s=0.25)
    took = time.monotonic() - started
    wait_for(f"job {job_id} COMPLETED in SLURM", lambda: state(job_id) == "COMPLETED", 30, poll_s=0.25)
    return took


def losses(run: Path) -> dict[int, float]:
    """step -> loss; a step run again after a resume from an older checkpoint keeps its last value."""
    return {m["step"]: m["loss"] for m in read_jsonl(RunDir(run).metrics) if "loss" in m}


def last_step(run: Path) -> int:
    return max(losses(run), default=0)


def final_sha(run: Path) -> str:
    finals = [m for m in read_jsonl(RunDir(run).metrics) if m.get("final")]
    assert finals, f"no final record in {RunDir(run).metrics}"
    return finals[-1]["weights_sha256"]


def placements(run: Path, role: str | None = None, restart: int | None = None) -> list[dict]:
    rows = read_jsonl(run / "placement.jsonl")
    return [r for r in rows if (role is None or r["role"] == role)
            and (restart is None or r["restart_count"] == restart)]


def restart_timing(run: Path, since_t: float, restart: int) -> dict[str, float]:
    """Seconds from `since_t` (the requeue) to the restart's processes starting (SLURM's part) and to its
    first step (the whole gap); `ours_s` is the difference: imports, rendezvous, checkpoint load."""
    after = [e for e in events(run, "first_step") if e["t"] > since_t]
    assert after, f"no first_step event after t={since_t} in {run}"
    first = after[0]
    started = min(r["t"] for r in placements(run, "train", restart))
    return {"to_first_step_s": first["t"] - since_t, "slurm_s": started - since_t, "ours_s": first["t"] - started}


def measure_line(name: str, timing: dict[str, float]) -> str:
    fixed_s = CRED_EXPIRE_S + KILL_WAIT_S
    return (f"MEASURE {name}: requeue -> training again {timing['to_first_step_s']:.2f} s "
            f"(SLURM requeue -> processes start {timing['slurm_s']:.2f} s, "
            f"start -> first step {timing['ours_s']:.2f} s); "
            f"minus SLURM's nominal delay cred_expire {CRED_EXPIRE_S} + KillWait {KILL_WAIT_S} s = "
            f"{timing['to_first_step_s'] - fixed_s:+.2f} s")


def train_node(sub: launch.Submission) -> str:
    """The node of het component 0, from SLURM."""
    (rec,) = [r for r in commands.show_job(sub.job_id) if r.get("HetJobOffset", "0") == "0"]
    return rec["NodeList"]


def kill_checkpoint_writer_and_requeue(sub, step: int, timeout_s: float, kick,
                                       requeue: bool = True) -> tuple[Path, int, float]:
    """SIGKILL rank 0 while it writes the step-`step` checkpoint (the job runs with the checkpoint pause
    hook), `scontrol requeue` the job (`requeue` False: leave that to the job's trainer supervisor) and wait
    until it is done. Asserts the skipped checkpoint is that half-written one and was tidied. Returns (its
    temp dir, the writer's pid, time of the kill)."""
    import os
    import signal

    from rlslurm.checkpoint import step_dirname
    from rlslurm.errors import SlurmCommandError

    run = RunDir(sub.run_dir)
    half: list[Path] = []

    def half_written() -> bool:
        half[:] = [p for p in run.checkpoints.glob(f".tmp-{step_dirname(step)}-*")
                   if (p / "model.safetensors").is_file()]
        return bool(half)
    wait_for(f"a half-written {step_dirname(step)} checkpoint", half_written, timeout_s, poll_s=0.05)
    (tmp,) = half
    writer_pid = int(tmp.name.rsplit("-", 1)[1])
    (rank0,) = [p for p in placements(sub.run_dir, "train", 0) if p["rank"] == 0]
    assert writer_pid == rank0["pid"]  # rank 0 writes; the temp dir is named after its pid
    os.kill(writer_pid, signal.SIGKILL)  # a node dying mid-write: no manifest, no rename
    killed_at = time.time()

    def requeued() -> bool:
        # Right after the kill the job may be COMPLETING, which scontrol refuses to requeue: try again.
        try:
            commands.requeue(sub.job_id)
            return True
        except SlurmCommandError as e:
            log.info("requeue not accepted yet: %s", e)
            return False
    if requeue:
        wait_for(f"SLURM to accept the requeue of {sub.job_id}", requeued, 30, poll_s=0.5)
    wait_done(sub.job_id, sub.run_dir, timeout_s, kick)

    skipped = events(sub.run_dir, "checkpoint_skipped")
    assert [e["checkpoint"] for e in skipped] == [tmp.name]
    assert skipped[0]["reason"] == f"incomplete: no manifest, writer pid {writer_pid} dead"
    assert not tmp.exists()  # the dead writer's temp dir is tidied
    return tmp, writer_pid, killed_at

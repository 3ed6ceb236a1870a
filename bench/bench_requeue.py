"""Requeue-to-training latency on the real local Slurm: how long a requeued job is away from training.

    python bench/bench_requeue.py            # 2 requeues by each trigger (~2.5 min on 2 cores)
    python bench/bench_requeue.py --quick    # 1 requeue by each trigger

Needs root and Debian's slurmctld/slurmd/munge (sbatch/install.sh); it starts its own cluster
(rlslurm/slurm/localcluster.py) on RLSLURM_SLURM_PORT_BASE, 22817 by default so that it does not meet the
tests' clusters, and stops it at the end.

One toy DDP job (jobs/toytrain.py: 2 train ranks + the rollout stand-in, as a het job) per trigger:
    scontrol requeue   SLURM SIGTERMs the job now and starts it again later
    rlslurm drain      the drain gate stops the ranks at a step boundary, they checkpoint and requeue
After the job has trained a few steps the trigger fires; the latency is from the trigger to the first
training step after the restart (its `first_step` event), split into SLURM's part (trigger -> the
restart's processes start: placement.jsonl) and rlslurm's part (start -> first step: imports,
rendezvous, checkpoint load). On this cluster SLURM's part has a fixed floor of munge's cred_expire
(5 s) + KillWait (5 s) for a SIGTERM requeue; a drain that checkpoints first exits on its own.

    ratio = trigger -> training again / SLURM's part      (1.0 = rlslurm adds nothing)

`run(quick)` returns the numbers as a dict (bench/run_all.py calls it); `main` prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

PORT_BASE = 22817
TRIGGERS = ("scontrol requeue", "rlslurm drain")
STEPS = 60
STEP_DELAY_S = 0.2
JOB_TIMEOUT_S = 240.0


def _wait(what: str, cond, timeout_s: float, kick=None, poll_s: float = 0.2):
    """Poll `cond` until it returns something truthy (returned), at most timeout_s; kick the scheduler ~1/s."""
    start = last_kick = time.monotonic()
    while time.monotonic() - start < timeout_s:
        got = cond()
        if got:
            return got
        if kick is not None and time.monotonic() - last_kick >= 1.0:
            kick()
            last_kick = time.monotonic()
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _config(path: Path, run_root: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "job": {"name": path.stem, "kind": "toy"},
        "hardware": {"profile": "cpu", "nodes": 2, "gpus_per_node": 2},
        "placement": {"mode": "separate", "rollout_nodes": 1},
        "train": {"steps": STEPS, "step_delay_s": STEP_DELAY_S},
        "checkpoint": {"interval_steps": 4, "kill_wait_s": 5, "cost_s": 0.5},
        "cluster": {"backend": "slurm", "time_limit_min": 10, "run_root": str(run_root)},
    }, sort_keys=False))
    return path


def _last_step(run) -> int:
    from rlslurm.rundir import read_jsonl

    return max((m["step"] for m in read_jsonl(run.metrics) if "loss" in m), default=0)


def _one_job(trigger: str, repeats: int, folder: Path, kick, log) -> list[dict]:
    """Submit a toy job, fire `trigger` `repeats` times (each after the restart trained 3 steps), finish it."""
    from rlslurm import launch
    from rlslurm.config import load_config
    from rlslurm.diag.drain_gate import request_drain
    from rlslurm.events import DONE, FIRST_STEP, read_events
    from rlslurm.rundir import RunDir, read_jsonl
    from rlslurm.slurm import commands

    config = _config(folder / f"{trigger.split()[0]}.yaml", folder / "runs")
    sub = launch.submit(load_config(config), config_text=config.read_text())
    run = RunDir(sub.run_dir)
    out = []
    try:
        for k in range(1, repeats + 1):
            since = _last_step(run) if k > 1 else 0
            _wait(f"job {sub.job_id} to train 3 steps", lambda since=since: _last_step(run) >= since + 3,
                  JOB_TIMEOUT_S, kick)
            fired_at = time.time()
            if trigger == "scontrol requeue":
                commands.requeue(sub.job_id)
            else:
                request_drain(run, "bench_requeue")
            first = _wait(f"job {sub.job_id} to train again after {trigger} #{k}",
                          lambda fired_at=fired_at: [e for e in read_events(run, FIRST_STEP) if e["t"] > fired_at],
                          JOB_TIMEOUT_S, kick)[0]
            started = min(p["t"] for p in read_jsonl(run.path / "placement.jsonl")
                          if p["role"] == "train" and p["restart_count"] == k)
            row = {"trigger": trigger, "total_s": first["t"] - fired_at, "slurm_s": started - fired_at,
                   "ours_s": first["t"] - started}
            log(f"  {trigger} #{k} (job {sub.job_id}): training again after {row['total_s']:.2f} s "
                f"(SLURM {row['slurm_s']:.2f} s, start -> first step {row['ours_s']:.2f} s)")
            out.append(row)
        _wait(f"job {sub.job_id} to finish", lambda: read_events(run, DONE), JOB_TIMEOUT_S, kick)
    finally:
        state = commands.show_job(sub.job_id)[0].get("JobState")
        if state not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            commands.scancel(sub.job_id)
    return out


def run(quick: bool = False, log=print) -> dict:
    """Start a local cluster, measure every trigger, stop the cluster; returns {"events": [...], ...}."""
    from rlslurm.slurm.localcluster import LocalCluster

    repeats = 1 if quick else 2
    port_base = int(os.environ.get("RLSLURM_SLURM_PORT_BASE", PORT_BASE))
    old_conf = os.environ.get("SLURM_CONF")
    with tempfile.TemporaryDirectory(prefix="bench-requeue-") as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster", port_base=port_base)
        try:
            up_s = cluster.up(timeout_s=60)
            os.environ["SLURM_CONF"] = str(cluster.conf)
            log(f"bench_requeue: local Slurm up in {up_s:.1f} s (port {port_base}); "
                f"{repeats} requeue(s) per trigger of a {STEPS}-step toy job")
            events = []
            for trigger in TRIGGERS:
                events += _one_job(trigger, repeats, Path(tmp), cluster.kick, log)
        finally:
            if old_conf is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old_conf
            cluster.down()
    return {"repeats": repeats, "cluster_up_s": up_s, "events": events}


def rows(result: dict) -> list[dict]:
    out = []
    for trigger in TRIGGERS:
        ev = [e for e in result["events"] if e["trigger"] == trigger]
        total, slurm, ours = (statistics.median(e[k] for e in ev) for k in ("total_s", "slurm_s", "ours_s"))
        out.append({"measure": f"requeue: {trigger} -> training again / SLURM's part",
                    "values": f"{total:.2f} s / {slurm:.2f} s (start -> first step {ours:.2f} s; median of {len(ev)})",
                    "ratio": total / slurm, "goal": "-", "ok": None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one requeue per trigger")
    result = run(ap.parse_args().quick)
    print()
    for r in rows(result):
        print(f"{r['measure']:<58} {r['values']:<64} {r['ratio']:7.3f}")


if __name__ == "__main__":
    main()

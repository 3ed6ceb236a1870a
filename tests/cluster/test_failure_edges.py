"""The edges a user meets around a failure (issue 19, part 6), against the real local Slurm: a submission sbatch
refuses leaves no run directory (a refused resume leaves the run as it was), and `rlslurm status` says when
SLURM does not answer, keeping the run's own lines.

    RLSLURM_SLURM_PORT_BASE=45817 python -m pytest -q tests/cluster/test_failure_edges.py
"""

from __future__ import annotations

import re
import socket
import time

import psutil
import pytest
import yaml
from click.testing import CliRunner

import spine_util as su
from rlslurm import events, launch
from rlslurm.cli.main import cli
from rlslurm.config import load_config
from rlslurm.diag.heartbeat import read_heartbeats
from rlslurm.jobs.toytrain import FAIL_ENV
from rlslurm.rundir import RunDir
from waiting import wait_for

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("option, slurm_says", [
    ("cluster.train_partition=nosuchpartition", "invalid partition specified: nosuchpartition"),
    ('cluster.extra_sbatch=["--constraint=nosuchfeature"]', "Invalid feature specification"),
])
def test_a_submission_sbatch_refuses_leaves_no_run_directory(slurm_cluster, tmp_path, option, slurm_says):
    root = tmp_path / "runs"
    config = su.toy_config(tmp_path / "refused.yaml", root)
    result = CliRunner().invoke(cli, ["submit", str(config), "--set", option])
    assert result.exit_code == 4, result.output  # SlurmCommandError
    assert slurm_says in result.output and "`sbatch --parsable " in result.output, result.output
    assert re.search(r"nothing was submitted; the run directory \S+ was removed", result.output), result.output
    assert not root.exists() or list(root.iterdir()) == []


def test_a_resume_sbatch_refuses_leaves_the_stopped_run_as_it_was(slurm_cluster, tmp_path):
    config = su.toy_config(tmp_path / "stopped.yaml", tmp_path / "runs")
    job = load_config(config)
    run, _ = launch.prepare(job, config_text=config.read_text())  # a stopped run: config, plan, no live job
    run.append_json(run.path / "submissions.jsonl", {"t": 1.0, "job_id": "1", "backend": "slurm"})
    before = {p.name: p.read_bytes() for p in (run.config, run.plan, run.path / "submissions.jsonl")}
    result = CliRunner().invoke(cli, ["resume", str(run.path), "--backend", "slurm",
                                      "--set", "cluster.train_partition=nosuchpartition"])
    assert result.exit_code == 4 and "invalid partition specified: nosuchpartition" in result.output, result.output
    assert {p.name: p.read_bytes() for p in (run.config, run.plan, run.path / "submissions.jsonl")} == before
    assert not run.jobs.exists() and not run.layout.exists()
    assert events.read_events(run) == []  # no config_changed, no submitted: nothing of the refused try


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_status_says_slurm_does_not_answer_and_keeps_the_runs_own_lines(slurm_cluster, tmp_path, monkeypatch):
    config = su.toy_config(tmp_path / "quiet.yaml", tmp_path / "runs")
    job = load_config(config)
    run, _ = launch.prepare(job, config_text=config.read_text())
    run.append_json(run.path / "submissions.jsonl", {"t": 1.0, "job_id": "4242", "backend": "slurm"})
    events.emit(run, events.START, step=0, restart_count=0)
    # The same cluster's configuration, its controller's port moved to one nothing listens on.
    conf = slurm_cluster.conf.read_text()
    dead = slurm_cluster.dir / "slurm-dead-port.conf"
    dead.write_text(re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={_dead_port()}", conf))
    monkeypatch.setenv("SLURM_CONF", str(dead))
    result = CliRunner().invoke(cli, ["status", str(RunDir(run.path).path)])
    assert result.exit_code == 0, result.output
    line = re.search(r"^SLURM: (.*)$", result.output, re.MULTILINE)
    assert line, result.output
    assert re.fullmatch(r"no answer about this job: `scontrol show job -o 4242` exited 1: slurm_load_jobs error: "
                        r"Unable to contact slurm controller \(connect failure\) \(after \d+\.\d s; timeout 30 s per "
                        r"SLURM command\); the lines below are the run directory's own \(heartbeats, checkpoints, "
                        r"events\)", line.group(1)), line.group(1)
    assert "last complete checkpoint: none" in result.output and " start main-0 step=0" in result.output


def test_resume_of_a_job_that_ended_failed_is_not_refused_by_its_fresh_failed_heartbeat(slurm_cluster, tmp_path,
                                                                                       monkeypatch):
    config = su.toy_config(tmp_path / "failing.yaml", tmp_path / "runs", step_delay_s=0.05)
    data = yaml.safe_load(config.read_text())
    data["diag"] = {"heartbeat_interval_s": 12.0}  # a heartbeat counts as fresh for 5 beats: 60 s
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    with monkeypatch.context() as mp:
        mp.setenv(FAIL_ENV, "3")  # rank 0 raises at step 3; sbatch exports it to the job
        sub = su.submit(config)
    wait_for(f"job {sub.job_id} FAILED", lambda: su.state(sub.job_id) == "FAILED", 120, on_poll=slurm_cluster.kick)
    run = RunDir(sub.run_dir)
    failed = [hb for hb in read_heartbeats(run) if hb.get("state") == "failed"]
    assert failed and all(time.time() - hb["written"] < 60 for hb in failed), read_heartbeats(run)
    result = CliRunner().invoke(cli, ["resume", str(run.path), "--set", "train.steps=4"])
    assert result.exit_code == 0 and "submitted slurm job " in result.output, (result.output, read_heartbeats(run))
    resumed = re.search(r"submitted slurm job (\d+)", result.output).group(1)
    su.TRACKED.append((resumed, run.path))
    su.wait_done(resumed, run.path, 180, slurm_cluster.kick)


def _batch_supervisor(run) -> psutil.Process:
    """The batch step's process of the run's job: python -m rlslurm.slurm.supervisor (its environment names the
    run directory)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["cmdline"] and "rlslurm.slurm.supervisor" in p.info["cmdline"]:
            try:
                if p.environ().get("RLSLURM_RUN_DIR") == str(run) or any(str(run) in a for a in p.info["cmdline"]):
                    found.append(p)
            except psutil.Error:
                continue
    assert len(found) == 1, found
    return found[0]


def test_the_batch_supervisor_killed_requeues_the_job_and_it_finishes(slurm_cluster, tmp_path):
    """Issue 28, case 2: `kill -9` of the batch script's supervisor ended every component FAILED and nothing
    requeued the job. The job's strigger (rlslurm/slurm/rejoin.py) now requeues it: it resumes from its
    newest checkpoint and ends COMPLETED with every step, and nothing of it is left on the machine."""
    import os
    import signal
    from pathlib import Path

    sub = su.submit(su.toy_config(tmp_path / "batch-killed.yaml", tmp_path / "runs", step_delay_s=0.3))
    run = Path(sub.run_dir)
    wait_for("the toy job past its first checkpoint", lambda: su.last_step(run) >= su.INTERVAL + 1, 240,
             on_poll=slurm_cluster.kick)
    os.kill(_batch_supervisor(run).pid, signal.SIGKILL)
    killed_at = time.time()
    su.wait_done(sub.job_id, run, 300, slurm_cluster.kick)
    found = su.events(run, "batch_requeued")
    assert len(found) == 1, found  # one requeue, though every component's trigger fired
    requeued = found[0]
    assert "FAILED by signal 9" in requeued["reason"] and requeued["result"].startswith("scontrol requeue"), requeued
    (resumed,) = su.events(run, "resume")
    assert resumed["restart_count"] == 1 and resumed["step"] >= su.INTERVAL, resumed
    assert sorted(su.losses(run)) == list(range(1, su.STEPS + 1))
    assert su.last_step(run) == su.STEPS and len(su.events(run, "done")) == 1
    wait_for("no process of the run left", lambda: not su.leftovers(run), 30, poll_s=0.5)
    back = min(p["t"] for p in su.placements(run, restart=1))
    print(f"\nMEASURE batch supervisor SIGKILL: requeued by the strigger {requeued['t'] - killed_at:.1f} s after, "
          f"running again {back - killed_at:.1f} s after, resumed from step {resumed['step']}")

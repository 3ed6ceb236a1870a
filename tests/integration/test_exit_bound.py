"""A finished job exits (issue 26 part 4; rlslurm/local_supervisor.py `end_outlivers`).

A trainer rank that is still running `train.exit_grace_s` after rank 0 exited 0 is named and ended: CI once
saw a finished run's rank 1 wait for good in gloo's process-group destructor. Here the SFT entrance runs on
2 local ranks, and rank 1 is held at interpreter exit, after its entrance returned (an atexit handler that
sleeps, planted through a sitecustomize on PYTHONPATH: the job's code is unchanged). The controller must
dump its stacks, end it, emit `rank_outlived_job`, count the run as finished, and `rlslurm status` says so;
no process of the run is left afterwards.

    python -m pytest -q -s tests/integration/test_exit_bound.py      # ~40 s on 2 cores
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
from click.testing import CliRunner

from exit_hold import plant_exit_hold
from procs import run_processes
from rlslurm import events, launch
from rlslurm.cli.main import cli
from rlslurm.config import load_config
from rlslurm.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 4.0



def test_a_rank_past_the_grace_after_rank_0_finished_is_ended_and_named(tmp_path, monkeypatch):
    held = plant_exit_hold(tmp_path, monkeypatch, rank_var="SUBMITIT_LOCAL_GLOBALID")
    path = ROOT / "examples" / "tiny-sft.yaml"
    job = load_config(path, (f"train.exit_grace_s={GRACE_S}", "train.steps=40", "train.warmup_steps=5",
                             "train.stop_at_accuracy=null"))
    sub = launch.submit(job, config_text=path.read_text(), backend="local", run_root=tmp_path / "runs")
    t0 = time.monotonic()
    results = launch.wait(sub, timeout_s=300, poll_s=0.5)
    assert [int(c) for c in results] == [0, 0], f"ended {results}; see {sub.run_dir}"
    assert held.exists(), "rank 1 was never held at exit: the test planted nothing"
    run = RunDir(sub.run_dir)
    (done,) = events.read_events(run, events.SFT_FINISHED)[:1]
    (outlived,) = events.read_events(run, events.RANK_OUTLIVED_JOB)
    assert outlived["stuck_rank"] == 1 and outlived["pid"] == int(held.read_text())
    assert outlived["grace_s"] == GRACE_S and outlived["ended"].startswith("SIGTERM")
    stacks = Path(outlived["stack_file"]).read_text()
    assert "_hold" in stacks, stacks[:2000]  # the stack names where it waited
    assert outlived["t"] - done["t"] >= GRACE_S
    print(f"\nrank 1 ended {outlived['t'] - done['t']:.1f} s after rank 0's sft_finished "
          f"(grace {GRACE_S} s), whole run {time.monotonic() - t0:.1f} s")
    status = CliRunner().invoke(cli, ["status", str(sub.run_dir)])
    assert status.exit_code == 0, status.output
    assert "rank 1 (pid" in status.output and "outlived the finished job" in status.output, status.output
    time.sleep(1.0)
    assert not psutil.pid_exists(outlived["pid"])
    assert run_processes(sub.run_dir) == []

"""Rank 0's engines start with the rank (rlslurm/rl/early.py), not after the trainer's imports and model load: a real
engine server, spawned from a thread while the caller goes on, handed to the Controller as it is, or stopped when
no Controller takes it.

    python -m pytest -q -s tests/integration/test_rl_early_engines.py   # ~15 s on 2 cores
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from rlslurm.config import load_config
from rlslurm.layout import JobLayout
from rlslurm.plan.report import build_plan
from rlslurm.rl import early
from rlslurm.rundir import RunDir
from rlslurm.tinymodel import build_model, save_hf

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, init_from: bool):
    export = tmp_path / "export"
    sets = ["rl.eval_every=100", "task.eval_size=16"] + ([f"train.init_from={export}"] if init_from else [])
    job = load_config(ROOT / "examples" / "tiny-grpo.yaml", sets)
    save_hf(build_model(job.model, seed=0), export, max_new_tokens=job.rollout.max_new_tokens)
    run = RunDir(tmp_path / "run").create()
    JobLayout.decide(job, build_plan(job), "local").write(run)  # what rlslurm submit writes
    return job, run, export


def _servers(run: RunDir) -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "rlslurm.rollout.server" in " ".join(p.cmdline())]


def test_engines_start_in_a_thread_and_the_controller_takes_them(tmp_path):
    job, run, export = _run(tmp_path, init_from=True)
    t = time.monotonic()
    assert early.start_engines(job, run, 0)
    assert time.monotonic() - t < 1.0  # returned at once: the caller imports torch meanwhile
    engines = early.take_engines(job, JobLayout.read(run), run, export)
    try:
        (server,) = _servers(run)
        assert engines.processes[0].proc.pid == server.pid
        assert engines.clients[0].health()["status"] == "ok"
        assert early._started == {}  # handed over: abandon() leaves the Controller's engines alone
        early.abandon()
        assert server.is_running()
    finally:
        engines.stop()


def test_engines_not_taken_are_stopped_and_none_start_where_they_cannot(tmp_path):
    job, run, export = _run(tmp_path, init_from=True)
    assert early.start_engines(job, run, 0)
    early.abandon()  # the rank failed before its Controller took them
    assert _servers(run) == []
    assert not early.start_engines(job, run, 1)  # only rank 0 spawns engines
    random_init, run2, _ = _run(tmp_path / "random", init_from=False)
    assert not early.start_engines(random_init, run2, 0)  # its model is written by the trainer, later


@pytest.fixture(autouse=True)
def _nothing_left():
    yield
    early.abandon()

"""Fixtures the RL pipeline tests share, one run each per test session: the SFT of examples/tiny-sft.yaml
(~15-40 s) and the synchronous GRPO run of examples/tiny-grpo.yaml from its export (~20-70 s).
test_rl_learns.py and test_rl_overlap.py both start from the same SFT, and the overlap test compares its
runs with the synchronous one, so running the two files together pays for each run once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

from rl_runs import evals, steps, submit_example
from rlslurm.config import JobConfig, load_config
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.tinymodel import build_model, save_hf


@pytest.fixture
def init_and_run(tmp_path) -> tuple[str, str]:
    """(HF dir of the embedded default at seed 0, an empty run dir): what spawned trainer ranks start from."""
    save_hf(build_model(JobConfig().model, seed=0), tmp_path / "init")
    RunDir(tmp_path / "run").create()
    return str(tmp_path / "init"), str(tmp_path / "run")


def once_per_session(tmp_path_factory, name: str, run: Callable[[Path], Path]) -> Path:
    """The run directory `run(root)` made, once per test session. Under `make test`'s two xdist workers each worker
    is a process with session fixtures of its own, and both made the SFT and the synchronous RL run (seen in a CI
    run's tmp dirs: ~2.5 min of its 2 cores): the first worker to ask makes it under a file lock in the session's
    shared tmp dir, the other reads its path. The tests only read these runs."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwK/
    with FileLock(str(shared / f"{name}.lock")):
        made = shared / f"{name}.run"
        if made.exists():
            return Path(made.read_text())
        run_dir = run(tmp_path_factory.mktemp(name))
        made.write_text(str(run_dir))
        return run_dir


@pytest.fixture(scope="session")
def sft(tmp_path_factory) -> dict:
    """{job, eval (the sft_eval metrics line: held_out_accuracy, export, ...), export, run_dir}."""
    run_dir = once_per_session(tmp_path_factory, "sft", lambda root: submit_example("tiny-sft.yaml", root)[1])
    (sft_eval,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "sft_eval"]
    return {"job": load_config(run_dir / "config.yaml"), "eval": sft_eval, "export": sft_eval["export"],
            "run_dir": run_dir}


@pytest.fixture(scope="session")
def rl_sync(sft, tmp_path_factory) -> dict:
    """examples/tiny-grpo.yaml from the SFT export, synchronous (rl.max_staleness 0): {job, run_dir, steps, evals}."""
    run_dir = once_per_session(tmp_path_factory, "rl-sync", lambda root: submit_example(
        "tiny-grpo.yaml", root, (f"train.init_from={sft['export']}", "rl.max_staleness=0"))[1])
    return {"job": load_config(run_dir / "config.yaml"), "run_dir": run_dir, "steps": steps(run_dir),
            "evals": evals(run_dir)}

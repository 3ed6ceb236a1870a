"""Fixtures the RL pipeline tests share, one run each per test session: the SFT of examples/tiny-sft.yaml
(~15-40 s) and the synchronous GRPO run of examples/tiny-grpo.yaml from its export (~20-70 s).
test_rl_learns.py and test_rl_overlap.py both start from the same SFT, and the overlap test compares its
runs with the synchronous one, so running the two files together pays for each run once."""

from __future__ import annotations

import pytest

from rl_runs import evals, steps, submit_example
from rlslurm.config import JobConfig
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.tinymodel import build_model, save_hf


@pytest.fixture
def init_and_run(tmp_path) -> tuple[str, str]:
    """(HF dir of the embedded default at seed 0, an empty run dir): what spawned trainer ranks start from."""
    save_hf(build_model(JobConfig().model, seed=0), tmp_path / "init")
    RunDir(tmp_path / "run").create()
    return str(tmp_path / "init"), str(tmp_path / "run")


@pytest.fixture(scope="session")
def sft(tmp_path_factory) -> dict:
    """{job, eval (the sft_eval metrics line: held_out_accuracy, export, ...), export, run_dir}."""
    job, run_dir = submit_example("tiny-sft.yaml", tmp_path_factory.mktemp("sft"))
    (sft_eval,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "sft_eval"]
    return {"job": job, "eval": sft_eval, "export": sft_eval["export"], "run_dir": run_dir}


@pytest.fixture(scope="session")
def rl_sync(sft, tmp_path_factory) -> dict:
    """examples/tiny-grpo.yaml from the SFT export, synchronous (rl.max_staleness 0): {job, run_dir, steps, evals}."""
    job, run_dir = submit_example("tiny-grpo.yaml", tmp_path_factory.mktemp("rl-sync"),
                                  (f"train.init_from={sft['export']}", "rl.max_staleness=0"))
    return {"job": job, "run_dir": run_dir, "steps": steps(run_dir), "evals": evals(run_dir)}

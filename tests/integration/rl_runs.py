"""Helpers of the RL pipeline tests (conftest.py's fixtures, test_rl_learns.py, test_rl_overlap.py): submit an
example through `launch.submit(..., backend="local")` and read back its steps, evaluations and trajectory."""

from __future__ import annotations

from pathlib import Path

from rlslurm import launch
from rlslurm.config import JobConfig, load_config
from rlslurm.rundir import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 540
"""Bound on one run: the 60-step RL example takes ~40-70 s on 2 shared cores."""


def submit_example(example: str, run_root: Path, overrides: tuple[str, ...] = ()) -> tuple[JobConfig, Path]:
    """Run examples/<example> with `overrides` to the end; every rank must exit 0."""
    path = ROOT / "examples" / example
    job = load_config(path, overrides)
    sub = launch.submit(job, config_text=path.read_text(), backend="local", run_root=run_root)
    results = launch.wait(sub, timeout_s=WAIT_S, poll_s=0.5)
    assert [int(code) for code in results] == [0] * len(results), f"{example} ended {results}; see {sub.run_dir}"
    return job, sub.run_dir


def steps(run_dir: Path) -> list[dict]:
    """The run's per-step metrics lines."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "policy_version" in r]


def evals(run_dir: Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy): the start's evaluation (an event), then the steps'."""
    out = [(0, e["held_out_accuracy"]) for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "eval"]
    return out + [(r["step"], r["held_out_accuracy"]) for r in steps(run_dir) if "held_out_accuracy" in r]


def trajectory(run_dir: Path) -> dict[int, tuple]:
    """step -> what the step trained on and did: equal trajectories are equal runs."""
    return {r["step"]: (r["reward_mean"], r["effective_samples"], r["loss"], r["grad_norm"]) for r in steps(run_dir)}

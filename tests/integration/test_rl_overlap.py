"""The RL job running ahead of its trainer (rl.max_staleness = 1, rlslurm/rl/pipeline.py): step n + 1's
rollout and reward run on policy n while step n trains, the weight sync waits for that rollout, and the
loss guards the one-version-old samples with the PPO ratio against the engine's logprobs. Same SFT start
and same example as test_rl_learns.py (the session fixtures of conftest.py).

    python -m pytest -q -s tests/integration/test_rl_overlap.py   # ~3.5 min with test_rl_learns.py; -s prints numbers

What must hold: overlapped RL still lifts held-out accuracy by >= 0.10 over SFT (measured here after 100
steps: ATEN_CPU_CAPABILITY=default 0.381 -> 0.561, the synchronous run 0.553; avx2 0.336 -> 0.500 and
0.498); every sample's staleness is within the bound and recorded; max_staleness 0 through the producer
thread is the synchronous trajectory, step for step; and a run resumed from an overlapped checkpoint (which
keeps the experience made ahead) follows the uninterrupted run exactly.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rl_runs import evals, steps, submit_example, trajectory
from rlslurm.events import read_events
from rlslurm.rl.pipeline import THREADED_ENV
from rlslurm.rundir import RunDir

MARGIN = 0.10
"""The gain over SFT test_rl_learns.py asks of the synchronous run (its docstring says why 0.10)."""


@pytest.fixture(scope="module")
def overlapped(sft, tmp_path_factory) -> dict:
    job, run_dir = submit_example("tiny-grpo.yaml", tmp_path_factory.mktemp("rl-overlap"),
                                  (f"train.init_from={sft['export']}", "rl.max_staleness=1"))
    rows, accs = steps(run_dir), evals(run_dir)
    print(f"\noverlapped RL (max_staleness 1): {' -> '.join(f'{a:.3f}@{s}' for s, a in accs)} "
          f"({sum(r['step_s'] for r in rows):.1f} s in steps, clip fraction max "
          f"{max(r['clip_fraction'] for r in rows):.3f})")
    return {"job": job, "run_dir": run_dir, "steps": rows, "evals": accs}


def test_overlapped_rl_beats_sft_on_held_out_problems(sft, overlapped):
    base, (last_step, acc) = sft["eval"]["held_out_accuracy"], overlapped["evals"][-1]
    assert last_step == overlapped["job"].train.steps
    assert overlapped["evals"][0] == (0, base)
    assert acc >= base + MARGIN, f"overlapped RL {acc:.3f} vs SFT {base:.3f}: the gain is under {MARGIN}"


def test_staleness_is_recorded_per_step_and_never_past_the_bound(overlapped):
    rows = overlapped["steps"]
    assert [r["step"] for r in rows] == list(range(1, overlapped["job"].train.steps + 1))
    # step 1 trains on the initial policy's samples (nothing to run ahead of); every later step on the
    # samples its predecessor's policy made while it trained: exactly one version behind.
    assert (rows[0]["staleness_max"], rows[0]["staleness_mean"]) == (0, 0.0)
    assert all((r["staleness_max"], r["staleness_mean"]) == (1, 1.0) for r in rows[1:])
    # the fresh step's engine sampled with the weights the trainer scored; the stale ones drifted a little
    assert rows[0]["engine_trainer_logprob_gap"] < 1e-3 and rows[0]["clip_fraction"] == 0.0
    assert all(0.0 < r["stale_logprob_drift"] < 0.5 and 0.0 <= r["clip_fraction"] < 0.5 for r in rows[1:])
    # the sync waited for the rollout made ahead, so the engines served each version in turn, verified
    verified = read_events(RunDir(overlapped["run_dir"]), "sync_verified")
    assert [e["version"] for e in verified] == list(range(overlapped["job"].train.steps + 1))


def test_the_phases_of_neighbouring_steps_overlapped(overlapped):
    rows = overlapped["steps"]
    # Phase seconds add up to more than the wall time only if some of them ran at the same time.
    busy = sum(r["rollout_s"] + r["reward_s"] + r["train_s"] + r["sync_s"] for r in rows[1:])
    wall = sum(r["step_s"] for r in rows[1:])
    assert busy > wall, f"{busy:.1f} s of phases in {wall:.1f} s of steps: nothing overlapped"


def test_zero_staleness_through_the_producer_thread_is_the_synchronous_trajectory(sft, rl_sync, tmp_path,
                                                                                    monkeypatch):
    # The thread with k = 0 must wait out every rollout and sync the inline job waits for: step for step
    # the synchronous run (whose first 10 steps do not depend on it running 60).
    monkeypatch.setenv(THREADED_ENV, "1")
    _, run_dir = submit_example("tiny-grpo.yaml", tmp_path, (f"train.init_from={sft['export']}",
                                                             "rl.max_staleness=0", "train.steps=10",
                                                             "rl.eval_every=100"))
    threaded = trajectory(run_dir)
    assert sorted(threaded) == list(range(1, 11))
    assert threaded == {s: t for s, t in trajectory(rl_sync["run_dir"]).items() if s <= 10}
    assert all(r["staleness_max"] == 0 for r in steps(run_dir))


def test_overlapped_and_synchronous_runs_share_their_first_step(rl_sync, overlapped):
    assert trajectory(overlapped["run_dir"])[1] == trajectory(rl_sync["run_dir"])[1]
    assert trajectory(overlapped["run_dir"])[2] != trajectory(rl_sync["run_dir"])[2]


def _start_ranks(run_dir: Path, world: int = 2, restart: int = 1) -> list[subprocess.Popen]:
    """The trainer ranks of one more start of the job in `run_dir`, as the local backend starts them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RLSLURM_RESTART_COUNT": str(restart),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for key in ("SLURM_JOB_ID", "RLSLURM_LEADER_JOB_ID", "SUBMITIT_EXECUTOR"):
            env.pop(key, None)
        log = open(run_dir.parent / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", f"from rlslurm.jobs.entry import run_component; run_component({str(run_dir)!r})"],
            env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def test_a_run_resumed_from_an_overlapped_checkpoint_follows_the_same_trajectory(overlapped, tmp_path):
    # The checkpoint 10 steps before the end (at = 90) keeps step at's experience, made on version at - 1 while
    # step at - 1 trained: no checkpoint holds those weights, so without it the resumed run could not make step
    # at as it was.
    original, last = overlapped["run_dir"], overlapped["job"].train.steps
    at = last - overlapped["job"].checkpoint.interval_steps
    ckpt = original / "checkpoints" / f"step-{at:08d}"
    assert ckpt.is_dir(), sorted(p.name for p in (original / "checkpoints").iterdir())
    run = RunDir(tmp_path / "resumed").create()
    shutil.copy(original / "config.yaml", run.path / "config.yaml")
    shutil.copy(original / "layout.json", run.path / "layout.json")
    shutil.copytree(ckpt, run.path / "checkpoints" / ckpt.name)
    procs = _start_ranks(run.path)
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "".join((tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(2))
    assert codes == [0, 0], logs
    (restored,) = read_events(run, "experience_restored")
    assert restored["steps"] == [at]
    resumed = trajectory(run.path)
    assert sorted(resumed) == list(range(at + 1, last + 1))
    assert resumed == {s: t for s, t in trajectory(original).items() if s > at}

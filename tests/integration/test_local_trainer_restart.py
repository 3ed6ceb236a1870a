"""Trainer ranks restart inside the run off SLURM too (issue 19, part 2; rlslurm/local_supervisor.py).

The toy job, 2 ranks on this machine through `--backend local`: rank 1 SIGKILLed after the step-4 checkpoint
ends rank 0 at once (not after a gloo timeout), every rank starts again from that checkpoint (the same
controller process, `trainer_restarted`), and the run ends with the uninterrupted run's losses and weights.
A rank that exits with an error is not restarted: the run ends as before, naming it.

    python -m pytest -q -s tests/integration/test_local_trainer_restart.py      # ~40 s on 2 cores
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from rlslurm import events, launch
from rlslurm.checkpoint import step_dirname
from rlslurm.config import load_config
from rlslurm.errors import RlslurmError
from rlslurm.local_supervisor import task_ends
from rlslurm.rundir import RunDir, read_jsonl
from waiting import wait_for

STEPS, INTERVAL = 12, 4


def toy(path: Path) -> launch.Submission:
    data = {"job": {"name": path.stem, "kind": "toy"}, "hardware": {"profile": "cpu", "nodes": 1, "gpus_per_node": 2},
            "placement": {"mode": "colocate"}, "train": {"steps": STEPS, "step_delay_s": 0.3},
            "checkpoint": {"interval_steps": INTERVAL, "cost_s": 0.1},
            "cluster": {"backend": "local", "time_limit_min": 5, "run_root": str(path.parent / "runs")}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return launch.submit(load_config(path), config_text=path.read_text())


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(RunDir(run).metrics) if "loss" in m}


def final_sha(run: Path) -> str:
    return [m for m in read_jsonl(RunDir(run).metrics) if m.get("final")][-1]["weights_sha256"]


def rank_pid(run: Path, rank: int) -> int:
    rows = [r for r in read_jsonl(run / "placement.jsonl") if r["role"] == "train" and r["rank"] == rank]
    return rows[-1]["pid"]


def test_task_ends_reads_exit_codes_as_srun_reports_them():
    (killed, term) = task_ends([-9, -15], first=[0], node="h")
    assert (killed.task, killed.how, killed.signal, killed.after_step_signal) == (0, "Killed", "SIGKILL", False)
    assert (term.task, term.signal, term.after_step_signal) == (1, "SIGTERM", True)
    (peer, dead) = task_ends([-15, -11], first=[1], node="h")  # the cause first, whatever its rank
    assert (peer.task, peer.signal) == (1, "SIGSEGV") and dead.task == 0
    (code,) = task_ends([0, 3], first=[1], node="h")
    assert (code.how, code.signal) == ("Exited with exit code 3", None)


def test_a_sigkilled_rank_restarts_every_rank_off_slurm_and_the_run_ends_as_the_uninterrupted_one(tmp_path):
    reference = toy(tmp_path / "reference.yaml")
    launch.check_results(reference, launch.wait(reference, timeout_s=240, poll_s=0.5))
    sub = toy(tmp_path / "killed.yaml")
    run = Path(sub.run_dir)
    wait_for("step 6", lambda: max(losses(run), default=0) >= INTERVAL + 2, 240, poll_s=0.1)
    victim = rank_pid(run, 1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    launch.check_results(sub, launch.wait(sub, timeout_s=240, poll_s=0.5))
    (restarted,) = events.read_events(RunDir(run), events.TRAINER_RESTARTED)
    assert (restarted["dead_rank"], restarted["signal"], restarted["cause"], restarted["trainer_restart"]) == \
        (1, "SIGKILL", "Killed", 1), restarted
    assert restarted["t"] - killed_at < 15  # rank 0 ended at once, not after train.dist_timeout_s
    (resume,) = events.read_events(RunDir(run), events.RESUME)
    assert resume["trainer_restart"] == 1 and resume["checkpoint"] == step_dirname(resume["step"])
    assert rank_pid(run, 1) != victim
    assert losses(run) == losses(reference.run_dir) and final_sha(run) == final_sha(reference.run_dir)
    print(f"\nMEASURE local trainer rank SIGKILL: kill -> trainer_restarted {restarted['t'] - killed_at:.2f} s -> "
          f"resumed {resume['t'] - restarted['t']:.2f} s")


def test_a_rank_that_raises_is_not_restarted(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSLURM_TEST_FAIL_AT_STEP", "3")  # rank 0 raises at step 3 (jobs/toytrain.py Faults)
    sub = toy(tmp_path / "raises.yaml")
    with pytest.raises(RlslurmError):
        launch.check_results(sub, launch.wait(sub, timeout_s=240, poll_s=0.5))
    assert not events.read_events(RunDir(sub.run_dir), events.TRAINER_RESTARTED)


def test_the_rl_job_restarts_its_ranks_and_ends_the_engine_the_killed_rank_0_left(tmp_path):
    """Rank 0 of the RL job (the controller, the engine's parent) SIGKILLed: the engine it spawned is ended,
    not left to init, and the new rank 0 starts one again, syncs and finishes the run from the checkpoint."""
    import psutil

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-grpo.yaml"
    job = load_config(example, ("train.steps=8", "rl.prompts_per_step=32", "rl.eval_every=100", "task.eval_size=16",
                                "checkpoint.interval_steps=3", "rollout.max_new_tokens=8"))
    sub = launch.submit(job, config_text=example.read_text(), backend="local", run_root=tmp_path)
    run = Path(sub.run_dir)
    steps = lambda: [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "policy_version" in r]  # noqa: E731
    wait_for("step 4", lambda: max(steps(), default=0) >= 4, 240, poll_s=0.1)
    (engine,) = [r for r in read_jsonl(run / "placement.jsonl") if r["role"] == "rollout"]
    os.kill(rank_pid(run, 0), signal.SIGKILL)
    launch.check_results(sub, launch.wait(sub, timeout_s=300, poll_s=0.5))
    (restarted,) = events.read_events(RunDir(run), events.TRAINER_RESTARTED)
    assert (restarted["dead_rank"], restarted["signal"]) == (0, "SIGKILL")
    assert not psutil.pid_exists(engine["pid"]) or psutil.Process(engine["pid"]).status() == psutil.STATUS_ZOMBIE
    engines = [r for r in read_jsonl(run / "placement.jsonl") if r["role"] == "rollout"]
    assert len(engines) == 2 and engines[1]["pid"] != engine["pid"]
    (resume,) = events.read_events(RunDir(run), events.RESUME)
    assert resume["step"] == 3 and resume["trainer_restart"] == 1
    assert sorted(set(steps())) == list(range(1, 9))
    assert [e["version"] for e in events.read_events(RunDir(run), events.SYNC_VERIFIED)
            if e["t"] > resume["t"]][:1] == [3]


def test_a_sigkilled_local_controller_takes_the_whole_run_along_and_the_run_resumes_at_once(tmp_path):
    """The local controller (what slurmstepd is on SLURM) SIGKILLed mid-run: its ranks end with it (the
    parent-death signal, SIGTERM: they drain), rank 0's engine and reward service with them; no process of
    the run is left on the machine, and `rlslurm resume` takes the run at once and finishes it (issue 28)."""
    from procs import run_processes

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-grpo.yaml"
    job = load_config(example, ("train.steps=40", "train.step_delay_s=0.3", "rl.prompts_per_step=32",
                                "rl.eval_every=100", "task.eval_size=16", "checkpoint.interval_steps=3"))
    sub = launch.submit(job, config_text=example.read_text(), backend="local", run_root=tmp_path)
    run = Path(sub.run_dir)
    steps = lambda: [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "policy_version" in r]  # noqa: E731
    wait_for("step 4", lambda: max(steps(), default=0) >= 4, 240, poll_s=0.1)
    before = {p.pid: " ".join(p.cmdline()[:4]) for p in run_processes(run)}
    roles = {r["role"] for r in read_jsonl(run / "placement.jsonl")}
    assert {"train", "rollout"} <= roles and len(before) >= 4, before  # controller, 2 ranks, engine (+ reward, agent)
    os.kill(int(sub.job_id), signal.SIGKILL)
    killed_at = time.monotonic()
    assert not events.read_events(RunDir(run), events.DONE)  # killed mid-run, not after the end
    wait_for("no process of the run left", lambda: not run_processes(run), 90, poll_s=0.2)
    gone_s = time.monotonic() - killed_at
    # Gone because they were ended, not because they finished: the run stopped short of its last step.
    assert not events.read_events(RunDir(run), events.DONE) and max(steps()) < 40, max(steps())
    assert launch.signs_of_life(RunDir(run), job, time.time()) is None
    again = launch.resume(str(run))
    launch.check_results(again, launch.wait(again, timeout_s=300, poll_s=0.5))
    assert sorted(set(steps())) == list(range(1, 41))
    assert not run_processes(run)
    print(f"\nMEASURE local controller SIGKILL at step >= 4: {len(before)} processes of the run, all gone "
          f"{gone_s:.1f} s later; resumed and finished")

"""The RL job with the reward service in place of the inline rule (examples/tiny-grpo.yaml, `reward.service:
local`): a supervised service process beside the controller, scored through the streaming client.

    python -m pytest -q -s tests/integration/test_rl_reward_service.py   # ~35 s on 2 idle cores, ~70 s busy

Both runs start from the random init (rewards are ~0 there; that the service scores as the inline rule
does is tests/unit/test_reward_scorers.py, and that RL still learns through it is test_rl_learns.py).
The second run SIGKILLs the service process while the job runs; with `reward.retries: 0` every response
of the step whose reward phase finds it dead is degraded at once (connection refused: nothing to wait
for), so the count is deterministic where a retry would race the restart (~1-2 s of uvicorn start here).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.events import read_events
from rlslurm.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
SMALL = ("rl.prompts_per_step=16", "rl.eval_every=100", "task.eval_size=64", "checkpoint.interval_steps=1000",
         "reward.service=local")


def _start(run_root: Path, overrides: tuple[str, ...]):
    job = load_config(EXAMPLE, SMALL + overrides)
    return job, launch.submit(job, config_text=EXAMPLE.read_text(), backend="local", run_root=run_root)


def _finish(sub) -> list[dict]:
    results = launch.wait(sub, timeout_s=240, poll_s=0.2)
    assert [int(code) for code in results] == [0] * len(results), f"ended {results}; see {sub.run_dir}"
    return [r for r in read_jsonl(sub.run_dir / "metrics.jsonl") if "policy_version" in r]


def test_rl_steps_are_scored_by_the_service(tmp_path):
    job, sub = _start(tmp_path, ("train.steps=3",))
    steps = _finish(sub)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert (r["reward_degraded"], r["reward_degraded_ratio"], r["reward_restarts"]) == (0, 0.0, 0)
        assert r["samples"] == job.rl.prompts_per_step * job.rl.samples_per_prompt and r["reward_s"] > 0
    # The service wore the phase guard, and the controller's close() stopped it cleanly.
    beat = json.loads((sub.run_dir / "heartbeats" / "reward-0.json").read_text())
    assert (beat["role"], beat["state"], beat["phase"]) == ("reward", "exited", None) and beat["beats"] > 3
    assert not read_events(RunDir(sub.run_dir), "reward_service_died")


def test_service_killed_mid_run_is_restarted_and_its_step_degraded_and_counted(tmp_path):
    job, sub = _start(tmp_path, ("train.steps=40", "reward.retries=0", "reward.neutral_score=0.5",
                                 "reward.health_interval_s=0.2", "reward.timeout_s=2"))
    run = RunDir(sub.run_dir)
    beat_file = run.heartbeats / "reward-0.json"
    deadline = time.monotonic() + 120
    # Two steps done: the next one is under way when the kill lands (the service is idle between rewards).
    while len([r for r in read_jsonl(run.metrics) if "policy_version" in r]) < 2:
        assert time.monotonic() < deadline and not sub.job.done(), f"no second step; see {sub.run_dir}"
        time.sleep(0.05)
    pid = json.loads(beat_file.read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    killed_after = len([r for r in read_jsonl(run.metrics) if "policy_version" in r])
    steps = _finish(sub)

    assert [r["step"] for r in steps] == list(range(1, job.train.steps + 1))  # every step completed
    (died,) = read_events(run, "reward_service_died")
    assert died["pid"] == pid and died["exit_code"] == -signal.SIGKILL
    (restarted,) = read_events(run, "reward_service_restarted")
    assert restarted["pid"] != pid and json.loads(beat_file.read_text())["pid"] == restarted["pid"]
    assert sum(r["reward_restarts"] for r in steps) == 1

    hit = [r for r in steps if r["reward_degraded"] > 0]
    table = [(r["step"], r["reward_degraded"], r["reward_restarts"]) for r in steps]
    # The step under way at the kill, or the next one when the kill landed after that step's reward phase; with
    # the rollout ahead of the trainer (rl.max_staleness k, the demo's 1) up to k steps later still.
    ahead = job.rl.max_staleness
    assert hit and killed_after + 1 <= hit[0]["step"] <= killed_after + 2 + ahead, (killed_after, ahead, table)
    first = hit[0]  # its reward phase found the service down: every response got neutral_score
    assert first["reward_degraded"] == first["samples"] and first["reward_degraded_ratio"] == 1.0
    assert first["reward_mean"] == 0.5 and first["effective_samples"] == 0
    # Degraded steps run back to back until the restart; none after it.
    assert [r["step"] for r in hit] == list(range(first["step"], hit[-1]["step"] + 1)), table
    assert all(r["reward_degraded"] == 0 for r in steps if r["step"] > hit[-1]["step"]), table
    alerts = read_events(run, "reward_degraded")
    assert [a["step"] for a in alerts] == [r["step"] - 1 for r in hit]  # the client counts steps from 0
    print(f"\nkilled pid {pid} after step {killed_after}; degraded steps {[r['step'] for r in hit]}, "
          f"restart took {restarted['start_s']} s")

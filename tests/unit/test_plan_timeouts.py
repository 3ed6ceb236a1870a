"""The timeout chain (rlslurm/plan/timeouts.py): `rlslurm plan` prints it led by the values, and `rlslurm submit`
refuses each order that cannot work, naming both keys, the numbers and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlslurm.cli.main import cli
from rlslurm.config import load_config
from rlslurm.plan.render import render_json, render_text
from rlslurm.plan.report import build_plan, preflight, timeouts

ROOT = Path(__file__).resolve().parents[2]
LECTURE = ROOT / "examples" / "lecture-h20.yaml"
TINY = ROOT / "examples" / "tiny-grpo.yaml"

# Each broken order: the overrides that break it (on the lecture's RL job on SLURM), and what the refusal says.
BROKEN = {
    "watchdog after the collective timeout": (
        ["train.dist_timeout_s=200"],
        ["diag.hang_timeout_s + diag.watch_interval_s", "301 s", "train.dist_timeout_s = 200 s",
         "sees only dead ranks", "set train.dist_timeout_s above 301 s"]),
    "a phase timeout of its own after the collective timeout": (
        ["diag.phase_timeouts_s={checkpoint: 2000}"],
        ["diag.phase_timeouts_s.checkpoint + diag.watch_interval_s", "2,001 s", "train.dist_timeout_s = 1,800 s",
         "or lower diag.phase_timeouts_s.checkpoint"]),
    "drain + checkpoint after the pre-timeout signal": (
        ["cluster.signal_before_s=600"],
        ["drain + checkpoint.cost_s = 902.8 s", "does not fit in cluster.signal_before_s = 600 s", "the step is lost",
         "set cluster.signal_before_s to at least 902.8 s"]),
    "a rollout request outlasting the watchdog": (
        ["rollout.request_timeout_s=400"],
        ["rollout.request_timeout_s = 400 s", "diag.hang_timeout_s = 300 s", "requeues the whole job",
         "set rollout.request_timeout_s at most 300 s, or raise diag.hang_timeout_s"]),
    "a sync stage outlasting the sync phase's own timeout": (
        ["diag.phase_timeouts_s={sync: 30}"],
        ["sync.timeout_s = 60 s", "diag.phase_timeouts_s.sync = 30 s",
         "set sync.timeout_s at most 30 s, or raise diag.phase_timeouts_s.sync"]),
    "a health check outlasting a scoring request": (
        ["reward.health_timeout_s=20"],
        ["reward.health_timeout_s = 20 s does not fire before reward.timeout_s = 10 s",
         "before the supervisor acts", "set reward.health_timeout_s at most 10 s, or raise reward.timeout_s"]),
    "reward retries outlasting the reward phase's timeout": (
        ["reward.timeout_s=120"],
        ["= 361.5 s does not fire before diag.hang_timeout_s = 300 s", "raise diag.hang_timeout_s above 361.5 s"]),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_submit_refuses_each_broken_order_naming_both_keys_and_the_fix(name, tmp_path):
    overrides, expected = BROKEN[name]
    plan = build_plan(load_config(LECTURE, overrides))
    problems = [p for p in preflight(plan) if p.startswith("timeout chain:")]
    assert len(problems) == 1, problems
    for text in expected:
        assert text in problems[0], (text, problems[0])
    result = CliRunner().invoke(cli, ["submit", str(LECTURE), *[f"--set={o}" for o in overrides], "--dry-run",
                                      "--backend", "slurm", "--run-root", str(tmp_path)])
    assert result.exit_code == 3, result.output  # PreflightError: nothing submitted
    assert problems[0] in result.output and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())


def test_the_lecture_prints_its_chain_led_by_the_values():
    out = render_text(build_plan(load_config(LECTURE)))
    chain = out[out.index("timeout chain"):out.index("warning:")].splitlines()
    values = [line.split(maxsplit=2) for line in chain[1:] if line.strip()[:1].isdigit()]
    assert [(value, key.split("  ")[0]) for value, _, key in values] == [
        ("1", "diag.watch_interval_s"), ("300", "diag.hang_timeout_s"), ("1,800", "train.dist_timeout_s"),
        ("120", "rollout.request_timeout_s"), ("60", "sync.timeout_s"), ("31.5", "reward: 3 x timeout_s + backoffs"),
        ("9", "reward: 3 x (health_interval_s + health_timeout_s)"), ("490", "checkpoint.cost_s"),
        ("412.8", "drain: one step"), ("1,200", "cluster.signal_before_s"), ("30", "checkpoint.kill_wait_s")]
    for line in ("ok      301 s watchdog (diag.hang_timeout_s + diag.watch_interval_s) fires before 1,800 s "
                 "train.dist_timeout_s",
                 "ok      902.8 s drain + checkpoint.cost_s fits in 1,200 s cluster.signal_before_s",
                 "ok      120 s rollout.request_timeout_s fires before 300 s diag.hang_timeout_s",
                 "note    490 s checkpoint.cost_s does NOT fit in 30 s checkpoint.kill_wait_s: on SIGTERM"):
        assert any(row.strip().startswith(line) for row in chain), (line, chain)
    assert "preflight: REFUSE: parallel.ep = 8" in out  # the chain is fine; EP 8 is what rlslurm cannot run yet
    data = json.loads(render_json(build_plan(load_config(LECTURE))))["timeout_chain"]
    assert data["timeouts_s"]["train.dist_timeout_s"] == 1800 and all(
        o["ok"] or not o["refuse"] for o in data["orders"])


def test_a_slow_detection_of_a_hung_reward_service_is_a_note_not_a_refusal():
    chain = timeouts(build_plan(load_config(LECTURE, ["reward.unhealthy_after=20"])))
    (note,) = [o for o in chain.orders if not o.ok and o.then != "checkpoint.kill_wait_s"]
    assert note.first.startswith("reward.unhealthy_after") and not note.refuse and not chain.problems()


def test_killwait_shorter_than_a_checkpoint_is_a_note_not_a_refusal():
    chain = timeouts(build_plan(load_config(LECTURE, ["checkpoint.kill_wait_s=5"])))
    (kill,) = [o for o in chain.orders if o.then == "checkpoint.kill_wait_s"]
    assert not kill.ok and not kill.refuse and not chain.problems()


def test_slurm_orders_are_not_judged_for_a_local_job():
    job = load_config(TINY, ["cluster.backend=local", "cluster.signal_before_s=0"])
    chain = timeouts(build_plan(job))
    assert not chain.problems() and all("signal" not in o.then for o in chain.orders)
    on_slurm = timeouts(build_plan(load_config(TINY, ["cluster.backend=slurm", "cluster.signal_before_s=0"])))
    assert any("cluster.signal_before_s" in p for p in on_slurm.problems())


def test_every_example_keeps_a_workable_chain():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        assert timeouts(build_plan(load_config(path, ["cluster.backend=slurm"]))).problems() == [], path

"""The reward service under a supervisor, with a judge scorer against a real stub OpenAI-compatible
server: rubric scoring and parse failures, then SIGKILL of the service in the middle of a step."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from rlslurm.events import read_events
from rlslurm.reward.client import RewardClient
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import Item
from rlslurm.reward.supervisor import RewardSupervisor, free_port
from rlslurm.rundir import RunDir
from rlslurm.secret import bearer


@pytest.fixture(scope="module")
def judge():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rlslurm.reward.judge_stub", "--port", str(port),
                             "--latency-s", "0.2"])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/health", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "judge stub did not start"
            time.sleep(0.1)
    yield url + "/v1"
    proc.kill()
    proc.wait()


def judge_cfg(endpoint: str, **kw) -> RewardConfig:
    base = dict(scorer="judge", endpoint=endpoint, concurrency=8, timeout_s=2.0, retries=4, retry_backoff_s=0.5,
                neutral_score=0.5, health_interval_s=0.2, health_timeout_s=1.0, unhealthy_after=2)
    return RewardConfig(**{**base, **kw})


def items(n: int, garbled: int = 0, wrong: int = 0) -> list[Item]:
    out = []
    for i in range(n):
        text = "garble" if i < garbled else ("the answer is 4" if i < garbled + wrong else "the answer is 19")
        out.append(Item(id=str(i), prompt="12+7=", response=text, reference="19"))
    return out


def test_judge_rubric_scores_and_counts_parse_failures(judge, tmp_path):
    run = RunDir(tmp_path).create()
    cfg = judge_cfg(judge, degraded_alert_ratio=0.1)

    async def step():
        async with RewardClient(cfg, sup.url, run=run) as client:
            scores = client.step(3)
            for item in items(10, garbled=2, wrong=3):
                scores.submit(item)
            seen = [o async for o in scores.as_completed()]
            return seen, scores.summary

    with RewardSupervisor(cfg, run=run) as sup:
        start = time.monotonic()
        outcomes, summary = asyncio.run(step())
        wall_s = time.monotonic() - start
        metrics = httpx.get(sup.url + "/metrics", headers=bearer(sup.token)).text
    by_id = {o.id: o for o in outcomes}
    assert [by_id[str(i)].score for i in range(10)] == [0.5, 0.5, 0.2, 0.2, 0.2] + [0.9] * 5
    assert [by_id[str(i)].degraded for i in range(10)] == [True] * 2 + [False] * 8
    assert "judge parse failure" in by_id["0"].reason
    assert "rlslurm_reward_judge_parse_failures_total 2" in metrics
    assert wall_s < 10 * 0.2  # concurrent, not 10 x 0.2 s in a row
    assert (summary.total, summary.degraded, summary.degraded_ratio) == (10, 2, 0.2)
    (event,) = read_events(run, "reward_degraded")
    assert (event["step"], event["degraded"], event["total"], event["policy"]) == (3, 2, 10, "neutral")


def test_service_killed_mid_step_is_restarted_and_retries_land(judge, tmp_path):
    run = RunDir(tmp_path).create()
    cfg = judge_cfg(judge)

    async def step(client_cfg: RewardConfig, number: int, n: int):
        async with RewardClient(client_cfg, sup.url, run=run) as client:
            scores = client.step(number)
            for item in items(n):
                scores.submit(item)
            await asyncio.sleep(0.3)  # a wave or two scored, the rest in flight or queued
            os.kill(sup.proc.pid, signal.SIGKILL)
            return await scores.finish(), scores.summary

    with RewardSupervisor(cfg, run=run) as sup:
        first_pid = sup.proc.pid
        outcomes, summary = asyncio.run(step(cfg, 1, 48))
        assert sup.restarts == 1 and sup.proc.pid != first_pid
        # Enough retries: every response lands, some of them on the restarted service.
        assert all(o.score == 0.9 and not o.degraded for o in outcomes), [o for o in outcomes if o.degraded]
        assert max(o.attempts for o in outcomes) >= 2
        assert summary.degraded_ratio == 0.0

        # No retries: responses in flight at the kill time out and are degraded to the neutral score.
        while not sup.healthy():
            time.sleep(0.1)
        outcomes, summary = asyncio.run(step(judge_cfg(judge, retries=0), 2, 48))
        deadline = time.monotonic() + 20  # the step ended before the new service was up
        while sup.restarts < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sup.restarts == 2
    degraded = [o for o in outcomes if o.degraded]
    assert 0 < len(degraded) < 48
    assert all(o.score == 0.5 for o in degraded) and all(o.score == 0.9 for o in outcomes if not o.degraded)
    assert summary.degraded == len(degraded) and summary.degraded_ratio == len(degraded) / 48
    kinds = [e["kind"] for e in read_events(run)]
    assert kinds.count("reward_service_died") == 2 and kinds.count("reward_service_restarted") == 2
    (event,) = read_events(run, "reward_degraded")
    assert event["step"] == 2 and event["degraded"] == len(degraded)


def test_stopped_service_counts_as_unhealthy_and_is_replaced(judge, tmp_path):
    run = RunDir(tmp_path).create()
    with RewardSupervisor(judge_cfg(judge), run=run) as sup:
        stopped = sup.proc.pid
        os.kill(stopped, signal.SIGSTOP)  # alive to poll(), silent to /health: a hang
        deadline = time.monotonic() + 20
        while sup.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sup.restarts == 1 and sup.proc.pid != stopped
        assert sup.healthy()
    (event,) = read_events(run, "reward_service_unhealthy")
    assert event["pid"] == stopped and event["failed_checks"] == 2


def test_a_service_stopped_by_sigterm_is_no_death_and_is_not_restarted(judge, tmp_path):
    """Issue 38: SLURM's SIGTERM (a requeue, a preemption, every drain on it) reaches the service, which exits 0;
    its supervisor took that for a death (`reward_service_died`, exit code 0) and started it again. Now it lets
    it go. The drain's USR1 reaches it too, and no longer ends it."""
    run = RunDir(tmp_path).create()
    with RewardSupervisor(judge_cfg(judge), run=run) as sup:
        pid = sup.proc.pid
        time.sleep(0.5)  # past the service's start, where it sets its signals
        os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        assert sup.proc.poll() is None and sup.healthy()
        os.kill(pid, signal.SIGTERM)
        assert sup.proc.wait(timeout=20) == 0
        time.sleep(1.0)  # five health intervals: a death would have been said and restarted by now
        assert sup.restarts == 0 and sup.proc.pid == pid and not sup.failed.is_set()
    assert read_events(run, "reward_service_died") == [] and read_events(run, "reward_service_restarted") == []

"""Reward bench: prints one table of ratios measured in one run.

    python bench/bench_reward.py                    # ~30 s on 2 cores
    python bench/bench_reward.py --responses 512 --concurrency 64 --latency-s 2 --executions 200

1. Judge throughput: a stub OpenAI-compatible judge with `latency_s` per reply, scored through the
   supervised reward service by the controller's client: measured / ideal, where ideal =
   responses / concurrency x latency (512 / 64 x 2 s = 16 s; the lecture's serial judge: 1024 s).
   Target: <= 1.1.
2. Sandbox cost: trivial programs through the sandbox (namespaces, rlimits, uid drop) vs. the same
   interpreter as a bare subprocess, both `cores` at a time: executions per second per core and the
   overhead per execution.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time

import click
import httpx

from rlslurm.reward.client import RewardClient
from rlslurm.reward.config import RewardConfig, SandboxConfig
from rlslurm.reward.items import Item
from rlslurm.reward.sandbox import Sandbox
from rlslurm.reward.supervisor import RewardSupervisor, free_port


def start_judge(latency_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rlslurm.reward.judge_stub", "--port", str(port),
                             "--latency-s", str(latency_s)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/health", timeout=1).raise_for_status()
            return proc, url + "/v1"
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("judge stub did not start") from None
            time.sleep(0.1)


def bench_judge(responses: int, concurrency: int, latency_s: float) -> dict:
    judge, endpoint = start_judge(latency_s)
    cfg = RewardConfig(scorer="judge", endpoint=endpoint, concurrency=concurrency, timeout_s=4 * latency_s + 5,
                       retries=0)
    try:
        with RewardSupervisor(cfg, log_dir=tempfile.mkdtemp(prefix="bench-reward-")) as sup:
            async def step():
                async with RewardClient(cfg, sup.url, token=sup.token) as client:
                    await client.step(0).finish()  # warm the connection pool outside the timing
                    scores = client.step(1)
                    start = time.monotonic()
                    for i in range(responses):
                        scores.submit(Item(id=str(i), prompt="12+7=", response="19", reference="19"))
                    outcomes = await scores.finish()
                    return time.monotonic() - start, outcomes
            wall_s, outcomes = asyncio.run(step())
    finally:
        judge.kill()
        judge.wait()
    ideal_s = responses / concurrency * latency_s
    return {"wall_s": wall_s, "ideal_s": ideal_s, "serial_s": responses * latency_s,
            "degraded": sum(o.degraded for o in outcomes)}


async def _run_many(n: int, parallel: int, one) -> float:
    gate = asyncio.Semaphore(parallel)

    async def guarded():
        async with gate:
            return await one()
    start = time.monotonic()
    results = await asyncio.gather(*(guarded() for _ in range(n)))
    assert all(results), "an execution failed"
    return time.monotonic() - start


def bench_sandbox(executions: int, cores: int) -> dict:
    program = "print(sum(range(1000)))\n"
    sandbox = Sandbox(SandboxConfig(), slots=cores)

    async def sandboxed():
        return (await sandbox.execute(program)).passed

    async def bare():
        proc = await asyncio.create_subprocess_exec(sandbox.python, "-I", "-S", "-c", program,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        await proc.communicate()
        return proc.returncode == 0

    try:
        asyncio.run(_run_many(cores, cores, sandboxed))  # warm the page cache
        sandbox_s = asyncio.run(_run_many(executions, cores, sandboxed))
        bare_s = asyncio.run(_run_many(executions, cores, bare))
    finally:
        sandbox.close()
    return {"mode": sandbox.mode, "sandbox_per_s_core": executions / sandbox_s / cores,
            "bare_per_s_core": executions / bare_s / cores,
            "sandbox_ms": 1000 * sandbox_s * cores / executions, "bare_ms": 1000 * bare_s * cores / executions}


@click.command()
@click.option("--responses", default=512, show_default=True)
@click.option("--concurrency", default=64, show_default=True)
@click.option("--latency-s", default=2.0, show_default=True, help="Judge stub seconds per reply.")
@click.option("--executions", default=200, show_default=True, help="Sandbox executions to time.")
def main(responses: int, concurrency: int, latency_s: float, executions: int) -> None:
    """Run both benches and print the table."""
    cores = len(os.sched_getaffinity(0))
    j = bench_judge(responses, concurrency, latency_s)
    s = bench_sandbox(executions, cores)
    ratio = j["wall_s"] / j["ideal_s"]
    rows = [
        ("judge: responses x latency / concurrency", f"{responses} x {latency_s:g} s / {concurrency}", ""),
        ("judge: measured / ideal", f"{j['wall_s']:.2f} s / {j['ideal_s']:.2f} s",
         f"{ratio:.3f} ({'ok' if ratio <= 1.1 else 'OVER'} <= 1.1)"),
        ("judge: measured / serial", f"{j['wall_s']:.2f} s / {j['serial_s']:.0f} s",
         f"{j['wall_s'] / j['serial_s']:.4f}"),
        ("judge: degraded responses", f"{j['degraded']} of {responses}", f"{j['degraded'] / responses:.3f}"),
        (f"sandbox ({s['mode']}) vs bare subprocess: exec/s/core",
         f"{s['sandbox_per_s_core']:.1f} vs {s['bare_per_s_core']:.1f}",
         f"{s['sandbox_per_s_core'] / s['bare_per_s_core']:.3f}"),
        ("sandbox vs bare: core-ms per execution", f"{s['sandbox_ms']:.1f} vs {s['bare_ms']:.1f}",
         f"{s['sandbox_ms'] / s['bare_ms']:.2f}x (+{s['sandbox_ms'] - s['bare_ms']:.1f} ms)"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'values':<26}  ratio")
    for name, values, ratio_text in rows:
        print(f"{name:<{width}}  {values:<26}  {ratio_text}")
    if ratio > 1.1:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The phase guard an engine server wears (role rollout): its flags, the guard, and the beat of its serving loop.

    rlslurm/rollout/server.py     the transformers engine: add_args, from_args, beats in its lifespan
    rlslurm/rollout/vllm_serve.py vLLM's server: its gate reads the same flags and beats from vLLM's event loop

Both engines are launched with the same flags (rlslurm/rl/engines.py engine_launch), so both write
heartbeats/rollout-<rank>.json, which the node agent, `rlslurm status` and `rlslurm diag` read.
"""

from __future__ import annotations

import argparse
import asyncio


async def beats(guard) -> None:
    """The engine's heartbeat: phase `rollout`, one progress beat per diag.heartbeat_interval_s from a task of
    the serving loop, not a thread: a stopped (SIGSTOP) or wedged server stops beating, which is what the node
    agent and `rlslurm diag` must see (its supervisor, rollout/supervisor.py, replaces it first)."""
    with guard.phase("rollout"):
        try:
            while True:
                guard.beat()
                await asyncio.sleep(guard.config.heartbeat_interval_s)
        except asyncio.CancelledError:  # the server stops: the phase ends, it did not fail
            return


def add_args(p: argparse.ArgumentParser) -> None:
    """The engine's phase-guard flags (rlslurm/rl/engines.py engine_launch); vLLM's gate reads them too."""
    p.add_argument("--run-dir", default=None, help="run directory: wear the phase guard (heartbeats) as role rollout")
    p.add_argument("--rank", type=int, default=0, help="this engine's index among the job's (its heartbeat's rank)")
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0, help="diag.heartbeat_interval_s")
    p.add_argument("--phase-timeout-s", type=float, default=300.0,
                   help="the heartbeat's phase timeout the node agent judges it by (diag's for phase rollout)")


def from_args(run_dir: str | None, rank: int, heartbeat_interval_s: float, phase_timeout_s: float):
    """The phase guard of an engine started with --run-dir: role rollout, rank `rank` (None without)."""
    if run_dir is None:
        return None
    from pathlib import Path

    from rlslurm.diag.config import DiagConfig
    from rlslurm.diag.guard import PhaseGuard
    from rlslurm.rundir import RunDir

    diag = DiagConfig(heartbeat_interval_s=heartbeat_interval_s, phase_timeouts_s={"rollout": phase_timeout_s})
    return PhaseGuard(RunDir(Path(run_dir)), "rollout", rank, diag)

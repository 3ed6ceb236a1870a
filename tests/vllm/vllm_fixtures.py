"""Helpers for the vllm tier: where the vLLM venv's interpreter is, and how an engine server starts."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("RLSLURM_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def start_vllm(model_dir: Path, log_dir: Path, vllm_python: Path, *extra: str):
    """A vLLM engine server process on a free loopback port (its log: log_dir/engine.log)."""
    from rlslurm.rollout.client import spawn_engine
    from rlslurm.sync.broadcast import free_port

    return spawn_engine(model_dir, port=free_port(), log_path=log_dir / "engine.log", engine="vllm",
                        python=str(vllm_python), extra_args=["--name", "policy", *extra],
                        env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
                        ready_timeout_s=240.0)

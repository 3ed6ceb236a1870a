"""Helpers for the vllm tier: where the vLLM venv's interpreter is, and how vLLM's server starts."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("RLSLURM_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def start_vllm_serve(model_dir: Path, log_dir: Path, vllm_python: Path, *, tp: int = 1, **kwargs):
    """vLLM's own OpenAI server (rollout.engine: vllm) on a free loopback port, its log log_dir/engine.log."""
    from rlslurm.rollout.vllm_serve import spawn_vllm_serve
    from rlslurm.sync.broadcast import free_port

    return spawn_vllm_serve(model_dir, port=free_port(), log_path=log_dir / "engine.log", python=str(vllm_python),
                            tp=tp, **kwargs)

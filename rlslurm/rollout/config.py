"""`rollout:` in a job YAML: the engines that generate samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: Literal["hf", "vllm"] = "hf"
    """hf = the light transformers engine (CPU default); vllm = the production engine."""
    python: str | None = None
    """Interpreter that runs each engine server process; null = the job's own. vllm on a CPU host
    needs its own venv (sbatch/install_vllm_cpu.sh makes .venv-vllm): set .venv-vllm/bin/python."""
    engines: int = 1
    """Rollout engine servers (one process each)."""
    tp: int = 1
    """Tensor-parallel size of one engine (GPUs per engine)."""
    max_new_tokens: int = 8
    """Tokens generated per sample at most."""
    temperature: float = 1.0
    """Sampling temperature for RL samples (evaluation is greedy)."""
    gpu_memory_utilization: float = 0.9
    """Share of GPU memory an engine may take (weights + KV cache)."""
    kv_bytes: float = 2.0
    """Bytes per KV-cache element (bf16 = 2)."""
    max_seq_len: int = 4096
    """Prompt + response tokens one sequence may hold in the KV cache."""
    request_timeout_s: float = 120.0
    """Seconds a generation request may take before the controller gives up on it."""

    def __post_init__(self):
        check(self.python is None or bool(str(self.python).strip()), "python",
              "must be an interpreter path, or null for the job's own")
        check(self.engines >= 1, "engines", "must be >= 1")
        check(self.tp >= 1, "tp", "must be >= 1")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        check(self.kv_bytes > 0, "kv_bytes", "must be > 0")
        check(self.max_seq_len >= 1, "max_seq_len", "must be >= 1")
        check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0 (seconds)")

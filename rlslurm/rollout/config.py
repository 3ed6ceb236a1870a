"""`rollout:` in a job YAML: the engines that generate samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check, check_path, check_range


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: Literal["hf", "vllm"] = "hf"
    """hf = the light transformers engine (CPU default); vllm = the production engine."""
    python: str | None = None
    """Interpreter that runs each engine server process; null = the job's own. vllm on a CPU host
    needs its own venv (sbatch/install_vllm_cpu.sh makes .venv-vllm): set .venv-vllm/bin/python."""
    engines: int = 1
    """Rollout engine servers (one process each); with separate placement a multiple of
    placement.rollout_nodes (each rollout node runs the same number). Range [1, 1024]."""
    tp: int = 1
    """Tensor-parallel size of one engine (GPUs per engine; the hf engine has none: 1). Range [1, 64]."""
    max_new_tokens: int = 8
    """Tokens generated per sample at most. Range [1, 1000000]."""
    temperature: float = 1.0
    """Sampling temperature for RL samples (evaluation is greedy). Range [0, 100]."""
    gpu_memory_utilization: float = 0.9
    """Share of GPU memory an engine may take (weights + KV cache). Range (0, 1]."""
    kv_bytes: float = 2.0
    """Bytes per KV-cache element (bf16 = 2). Range [0.125, 16]."""
    max_seq_len: int = 4096
    """Prompt + response tokens one sequence may hold in the KV cache. Range [1, 1e8]."""
    request_timeout_s: float = 120.0
    """Seconds a generation request may take before the controller gives up on it. Range (0, 86400]."""

    def __post_init__(self):
        check(self.python is None or bool(str(self.python).strip()), "python",
              "must be an interpreter path, or null for the job's own")
        check_path(self.python, "python")
        check_range(self.engines, "engines", 1, 1024)
        check_range(self.tp, "tp", 1, 64)
        check_range(self.max_new_tokens, "max_new_tokens", 1, 1_000_000, note="tokens")
        check_range(self.temperature, "temperature", 0, 100)
        check_range(self.gpu_memory_utilization, "gpu_memory_utilization", 0, 1, low_open=True)
        check_range(self.kv_bytes, "kv_bytes", 0.125, 16, note="bytes per element")
        check_range(self.max_seq_len, "max_seq_len", 1, 10**8, note="tokens")
        check_range(self.request_timeout_s, "request_timeout_s", 0, 86_400, low_open=True, note="seconds")

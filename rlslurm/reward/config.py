"""`reward:` in a job YAML: how responses are scored, how the service is run and supervised, how the
code scorer's sandbox is bounded, and what happens when scoring fails.

    reward:
      scorer: code
      service: local
      concurrency: 64
      batch_size: 1
      sandbox: {cpu_s: 2, mem_mb: 512, wall_s: 5}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlslurm.configfile import check, check_path, check_range, check_text
from rlslurm.slurm.config import check_partition

_URL = re.compile(r"https?://[^\s\x00-\x1f\x7f]+")

DEFAULT_RUBRIC = (
    "You grade a model's answer against a reference answer. Reply with one line `SCORE: x` where x is a "
    "number from 0 (wrong or off-topic) to 10 (correct, complete and clearly stated)."
)


DEFAULT_NAME = "compute_score"


def split_spec(spec: str) -> tuple[Path, str]:
    """("rewards.py", "compute_score") of reward.function = "rewards.py[:compute_score]"."""
    path, _, name = spec.rpartition(":") if spec.rpartition(":")[0].endswith(".py") else (spec, "", "")
    return Path(path), name or DEFAULT_NAME


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    mode: Literal["auto", "root", "userns"] = "auto"
    """How code is isolated (both: bubblewrap's namespaces, a read-only minimal filesystem, no capabilities,
    no_new_privs, a seccomp filter): root = bwrap as root, then a dropped uid per slot (needs root);
    userns = an unprivileged user namespace (the service's uid outside); auto = root when running as root,
    else userns."""
    require_isolation: bool = True
    """Refuse to run code when no isolation works here (no bubblewrap, libseccomp or namespaces: true),
    instead of running it with rlimits only in a host temp dir (false: never for model-written code outside
    a test box)."""
    python: str = "python3"
    """Interpreter that runs the program, found on /usr/local/bin:/usr/bin:/bin; it must live under /usr (the
    sandbox shows the host's /usr, read-only, and no other host directory) and the dropped uid must be able
    to execute it."""
    cpu_s: int = 2
    """CPU seconds per execution (RLIMIT_CPU). Range [1, 3600]."""
    wall_s: float = 5.0
    """Wall seconds per execution before its whole process group (and uid) is killed. Range (0, 3600]."""
    mem_mb: int = 512
    """Address space per process in MiB (RLIMIT_AS). Range [1, 1000000]."""
    nproc: int = 32
    """Processes of one execution (RLIMIT_NPROC: per slot uid in mode root, per user namespace in mode
    userns). Range [1, 4096]."""
    fsize_mb: int = 16
    """Largest file it may write, MiB (RLIMIT_FSIZE). Range [1, 1000000]."""
    disk_mb: int = 64
    """Size of its throwaway working directory /tmp (a tmpfs, its one writable mount: the total it may
    write), MiB. Range [1, 1000000]."""
    nofile: int = 64
    """Open file descriptors (RLIMIT_NOFILE). Range [1, 65536]."""
    output_kb: int = 64
    """Bytes of stdout and of stderr kept, KiB; one byte more and the execution is killed. Range [1, 1000000]."""
    uid_base: int = 61000
    """First uid of the per-slot uids (slot i runs as uid_base + i: on the host in mode root and for a root
    service in mode userns, where none should own files; inside its user namespace in mode userns).
    Range [1000, 4000000000]."""

    def __post_init__(self):
        check_path(self.python, "python")
        check_range(self.cpu_s, "cpu_s", 1, 3600, note="CPU seconds")
        check_range(self.wall_s, "wall_s", 0, 3600, low_open=True, note="seconds")
        for key in ("mem_mb", "fsize_mb", "disk_mb", "output_kb"):
            check_range(getattr(self, key), key, 1, 1_000_000)
        check_range(self.nproc, "nproc", 1, 4096)
        check_range(self.nofile, "nofile", 1, 65_536)
        check_range(self.uid_base, "uid_base", 1000, 4_000_000_000, note="stay clear of system uids")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    scorer: Literal["rule", "code", "function", "model", "judge"] = "rule"
    """rule = the final answer against the reference (plain numbers exactly, else math-verify); code = the
    row's unit tests in the sandbox (HumanEval's layout); function = a user's verl-style compute_score
    (reward.function); model = an RM endpoint; judge = an LLM."""
    function: str | None = None
    """The reward function of scorer `function`: FILE.py[:NAME] (NAME defaults to compute_score), the path
    relative to the working directory; called as NAME(data_source, solution_str, ground_truth,
    extra_info=None), returning a finite number or a dict with "score"; at most 4096 characters."""
    service: Literal["inline", "local", "component"] = "inline"
    """inline = scored in the controller; local = a supervised subprocess; component = its own SLURM het component."""
    partition: str | None = None
    """SLURM partition of the reward component (service: component)."""
    concurrency: int = 64
    """Requests in flight from the client, and responses scored at once by the service. Range [1, 4096]."""
    batch_size: int = 1
    """Responses per POST /score: 1 = each on its own (behind a slow judge the lowest latency); more spread
    the ~1 ms of HTTP work per request of a fast scorer (rule: 512 responses ~0.4 s one by one, ~0.02 s in 64s).
    Range [1, 4096]."""
    latency_s: float = 0.01
    """Expected seconds to score one response (the planner's reward phase = count x latency / concurrency).
    Range [0, 86400]."""
    timeout_s: float = 10.0
    """Seconds one scoring request may take before it is retried. Range (0, 86400]."""
    retries: int = 2
    """Retries (with backoff) before a response is degraded. Range [0, 100]."""
    retry_backoff_s: float = 0.5
    """Seconds before the first retry; doubled for each further one. Range [0, 3600]."""
    degrade: Literal["drop", "neutral", "fail"] = "neutral"
    """What a response that could not be scored becomes: dropped, scored `neutral_score`, or the step fails."""
    neutral_score: float = 0.0
    """Score given to degraded responses when degrade = neutral (a reward, like every score). Range [0, 1]."""
    degraded_alert_ratio: float = 0.05
    """An event is written when the degraded share of a step rises past this. Range [0, 1]."""
    endpoint: str | None = None
    """URL of the reward model or judge (scorer: model | judge): http:// or https://, at most 2048 characters."""
    judge_model: str = "judge"
    """Model name sent to the judge's OpenAI-compatible chat endpoint; at most 256 characters."""
    judge_rubric: str = DEFAULT_RUBRIC
    """System prompt of the judge; its reply must contain `SCORE: x` with x in [0, judge_max_score]; at most
    20000 characters."""
    judge_max_score: float = 10.0
    """The judge's top mark; scores are divided by it to land in [0, 1]. Range (0, 1000000]."""
    format_regex: str | None = None
    """Rule scorer: a response that does not match this (re.search) scores 0 with reason `format`; at most
    1000 characters."""
    port: int = 0
    """Port of the local service; 0 = a free one chosen at start and kept across restarts. Range [0, 65535]."""
    open_data_plane: bool = False
    """Score (POST /score) for callers without the job's secret too; false: only the job's own. /health is
    always open, /metrics never."""
    max_items_per_request: int = 1024
    """Items one POST /score may carry; more is a 400 (reward.batch_size must fit). Range [1, 1000000]."""
    max_item_bytes: int = 65536
    """Bytes of one item's text (response + prompt + reference + tests + id); a larger item comes back
    unscored, and the scorer never sees it. Range [1024, 1e9]."""
    health_interval_s: float = 1.0
    """Seconds between the supervisor's health checks. Range [0.01, 3600]."""
    health_timeout_s: float = 2.0
    """Seconds one health check may take. Range (0, 3600]."""
    unhealthy_after: int = 3
    """Consecutive failed health checks before a live service is restarted. Range [1, 1000]."""
    start_timeout_s: float = 30.0
    """Seconds a (re)started service may take to answer /health. Range (0, 86400]."""
    max_restarts: int = 10
    """Restarts before the supervisor gives up and the reward phase fails. Range [0, 1000]."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits of the code scorer's sandbox."""

    def __post_init__(self):
        check_partition(self.partition, "partition")
        for key in ("concurrency", "batch_size"):
            check_range(getattr(self, key), key, 1, 4096)
        check_range(self.latency_s, "latency_s", 0, 86_400, note="seconds")
        check_range(self.timeout_s, "timeout_s", 0, 86_400, low_open=True, note="seconds")
        check_range(self.retries, "retries", 0, 100)
        check_range(self.retry_backoff_s, "retry_backoff_s", 0, 3600, note="seconds")
        check_range(self.neutral_score, "neutral_score", 0, 1)
        check_range(self.max_items_per_request, "max_items_per_request", 1, 1_000_000)
        check(self.batch_size <= self.max_items_per_request, "batch_size",
              f"= {self.batch_size} is over reward.max_items_per_request = {self.max_items_per_request}: "
              "the service would refuse every request")
        check_range(self.max_item_bytes, "max_item_bytes", 1024, 10**9, note="bytes")
        check(0 <= self.degraded_alert_ratio <= 1, "degraded_alert_ratio", "must be in [0, 1]")
        if self.endpoint is not None:
            check_text(self.endpoint, "endpoint", 2048)
            check(_URL.fullmatch(self.endpoint) is not None, "endpoint",
                  "must be an http:// or https:// URL without blanks")
        check_text(self.judge_model, "judge_model", 256)
        check_text(self.judge_rubric, "judge_rubric", 20_000, lines=True)
        check_range(self.judge_max_score, "judge_max_score", 0, 1_000_000, low_open=True)
        check_text(self.format_regex, "format_regex", 1000)
        check(0 <= self.port < 65536, "port", "must be in [0, 65535]")
        # A health check at least every 10 ms: below it the supervisor's monitor only spins.
        check_range(self.health_interval_s, "health_interval_s", 0.01, 3600, note="seconds")
        check_range(self.health_timeout_s, "health_timeout_s", 0, 3600, low_open=True, note="seconds")
        check_range(self.unhealthy_after, "unhealthy_after", 1, 1000)
        check_range(self.start_timeout_s, "start_timeout_s", 0, 86_400, low_open=True, note="seconds")
        check_range(self.max_restarts, "max_restarts", 0, 1000)
        if self.scorer == "function":
            check(bool(self.function), "function", "is required when reward.scorer = 'function' "
                  "(FILE.py[:NAME], e.g. rewards.py:compute_score)")
        if self.function is not None:
            check_text(self.function, "function", 4096)
            path, _ = split_spec(self.function)
            check(path.suffix == ".py" and path.is_file(), "function",
                  f"= {self.function!r}: {path} is not a .py file here ({Path.cwd()}); the form is FILE.py[:NAME]")
        if self.scorer in ("model", "judge"):
            check(bool(self.endpoint), "endpoint", f"is required when reward.scorer = {self.scorer!r}")
        if self.format_regex is not None:
            try:
                re.compile(self.format_regex)
            except (re.error, RecursionError, OverflowError) as e:  # sre_parse recurses once per nested group
                check(False, "format_regex", f"is not a valid regular expression ({type(e).__name__}: {e})")

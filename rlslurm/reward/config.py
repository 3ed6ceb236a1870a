"""`reward:` in a job YAML: how responses are scored and what happens when scoring fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    scorer: Literal["rule", "code", "model", "judge"] = "rule"
    """rule = exact answer / format match; code = unit tests in the sandbox; model = an RM endpoint; judge = an LLM."""
    service: Literal["inline", "local", "component"] = "inline"
    """inline = scored in the controller; local = a supervised subprocess; component = its own SLURM het component."""
    partition: str | None = None
    """SLURM partition of the reward component (service: component)."""
    concurrency: int = 64
    """Responses scored at once."""
    latency_s: float = 0.01
    """Expected seconds to score one response (the planner's reward phase = count x latency / concurrency)."""
    timeout_s: float = 10.0
    """Seconds one scoring request may take before it is retried."""
    retries: int = 2
    """Retries (with backoff) before a response is degraded."""
    degrade: Literal["drop", "neutral", "fail"] = "neutral"
    """What a response that could not be scored becomes: dropped, scored `neutral_score`, or the step fails."""
    neutral_score: float = 0.0
    """Score given to degraded responses when degrade = neutral."""
    degraded_alert_ratio: float = 0.05
    """An event is written when the degraded share of a step rises past this."""
    endpoint: str | None = None
    """URL of the reward model or judge (scorer: model | judge)."""

    def __post_init__(self):
        check(self.concurrency >= 1, "concurrency", "must be >= 1")
        check(self.latency_s >= 0, "latency_s", "must be >= 0 (seconds)")
        check(self.timeout_s > 0, "timeout_s", "must be > 0 (seconds)")
        check(self.retries >= 0, "retries", "must be >= 0")
        check(0 <= self.degraded_alert_ratio <= 1, "degraded_alert_ratio", "must be in [0, 1]")
        if self.scorer in ("model", "judge"):
            check(bool(self.endpoint), "endpoint", f"is required when reward.scorer = {self.scorer!r}")

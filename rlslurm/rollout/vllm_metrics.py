"""vLLM's Prometheus /metrics (text exposition), parsed; read by the engine supervisor to tell a hang:
requests running and no token made.

    samples = parse(text)                              # [(name, labels, value)]; VLLMServeClient.metrics()
    m = Progress.of(samples)                           # requests running, generation tokens so far
    watch = ProgressWatch(hang_timeout_s=15.0)
    watch.update(m, now) -> str | None                 # the cause, once running work made no token for that long

vLLM V1 runs its scheduler and model in an EngineCore child process; the API server answers /health from
its own process, so an EngineCore that is stopped (SIGSTOP), wedged in a kernel or stuck in a collective
leaves /health answering 200 while nothing progresses. What does stop is the EngineCore's stream of
outputs, and with it vLLM's own counters: `vllm:generation_tokens_total` (a counter, tokens generated)
stays put while `vllm:num_requests_running` (a gauge, the scheduler's last report) stays above zero.
Running, not waiting: a paused engine (the weight sync's DRAIN, /pause?mode=wait) finishes its running
requests and then may hold new ones waiting for as long as an update takes, which is no hang. Limitation:
an EngineCore that stops while idle is not seen here (its gauges stay at zero); a request sent to it then
fails at rollout.request_timeout_s.

Hand-written parser: prometheus_client (whose text parser this would be) is in the vLLM venv but not in the
main venv, where the supervisor and the tests run; the text format is simple (https://prometheus.io/docs/instrumenting/
exposition_formats/: `name{label="value",...} value [timestamp]`, `#` lines are comments).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition: (name, labels, value). A line that is not a sample or a
    comment raises ValueError naming it (a truncated answer must not read as zero)."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"metrics line {number} is not a Prometheus sample: {line[:200]!r}")
        name, labels_text, value = m.group(1), m.group(2), m.group(3)
        labels: dict[str, str] = {}
        if labels_text:
            body, pos = labels_text[1:-1], 0
            while pos < len(body):
                lm = _LABEL.match(body, pos)
                if not lm:
                    raise ValueError(f"metrics line {number}: bad labels {labels_text[:200]!r}")
                labels[lm.group(1)] = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], lm.group(2))
                pos = lm.end()
        try:
            out.append((name, labels, float(value)))  # float() reads +Inf, -Inf and NaN too
        except ValueError:
            raise ValueError(f"metrics line {number}: value {value!r} is not a number") from None
    return out


def total(samples: list[tuple[str, dict[str, str], float]], name: str) -> float | None:
    """The sum of `name` over all its label sets (vLLM labels by model and engine), None if absent."""
    values = [v for n, _, v in samples if n == name and not math.isnan(v)]
    return sum(values) if values else None


@dataclass(frozen=True)
class Progress:
    """What one /metrics answer says about an engine's work."""

    pending: float
    """Requests running in vLLM's scheduler (scheduled, being generated)."""
    generated: float
    """Tokens generated since the server started (a counter)."""

    @classmethod
    def of(cls, samples: list[tuple[str, dict[str, str], float]]) -> "Progress":
        missing = [n for n in (RUNNING, GENERATED) if total(samples, n) is None]
        if missing:
            raise ValueError(f"vLLM's /metrics has no {', '.join(missing)} (is --disable-log-stats set?)")
        return cls(pending=total(samples, RUNNING), generated=total(samples, GENERATED))


class ProgressWatch:
    """Hang detection from successive Progress readings: requests running and no new token for hang_timeout_s."""

    def __init__(self, hang_timeout_s: float):
        self.hang_timeout_s = hang_timeout_s
        self._since: float | None = None  # when the counter last moved with work pending
        self._last: Progress | None = None

    def update(self, progress: Progress, now: float) -> str | None:
        """Record a reading taken at `now`; the cause of a hang, or None."""
        last, self._last = self._last, progress
        if progress.pending <= 0 or last is None or progress.generated != last.generated:
            self._since = now if progress.pending > 0 else None
            return None
        if self._since is None:
            self._since = now
        stalled_s = now - self._since
        if stalled_s < self.hang_timeout_s:
            return None
        return (f"vLLM's /metrics: {progress.pending:g} requests running and "
                f"{GENERATED} unchanged at {progress.generated:g} for {stalled_s:.1f} s "
                f"(rollout.hang_timeout_s = {self.hang_timeout_s:g}): its EngineCore makes no progress")

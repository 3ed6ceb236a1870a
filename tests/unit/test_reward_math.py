"""The rule scorer on math answers: plain numbers compared here, everything else through math-verify."""

from __future__ import annotations

import threading
import time

import pytest

from rlslurm.reward.answers import gsm8k_final, rule_verdict
from rlslurm.reward.math_answers import rule_score


@pytest.mark.parametrize("response, reference, score", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so the answer is \\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 1,000", "1000", 1.0),
    ("the answer is 72", "She sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ("the answer is 71", "She sold 48/2 = 24 clips in May.\n#### 72", 0.0),
    ("the answer is $\\pi/2$", "\\frac{\\pi}{2}", 1.0),
    ("so $x = \\boxed{\\sqrt 2}$", "\\sqrt{2}", 1.0),
    ("so $x = \\boxed{\\sqrt 3}$", "\\sqrt{2}", 0.0),
    ("The answer is 7 apples", "7", 1.0),
    ("answer: Paris", "paris", 1.0),
    ("answer: Rome", "paris", 0.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
])
def test_math_answers(response, reference, score):
    scored = rule_score(response, reference)
    assert scored.score == score, scored.reason


def test_plain_numbers_never_reach_math_verify():
    """The embedded arithmetic task's answers are decided by exact fractions, as before the library came."""
    assert rule_verdict("12 + 7 = 19", "19").score == 1.0
    assert rule_verdict("19", "20").score == 0.0
    assert rule_verdict("no digits", "19").score == 0.0
    assert rule_verdict("she has 72", "48/2 = 24\n#### 72").score == 1.0  # GSM8K's reference: its final line
    assert rule_verdict("\\boxed{\\frac{1}{2}}", "0.5") is None  # LaTeX: math-verify's


def test_gsm8k_final():
    assert gsm8k_final("work\n#### 1,234\n") == "1,234"
    assert gsm8k_final("no marker") == "no marker"


def test_long_numbers_are_text_and_fast():
    start = time.monotonic()
    assert rule_score("\\boxed{" + "9" * 5000 + "^{10^{10}}}", "\\frac{1}{2}").score == 0.0
    assert time.monotonic() - start < 2


def test_off_the_main_thread_without_signals():
    """math-verify's signal.alarm timeouts raise off the main thread: rule_score turns them off there."""
    out = []
    thread = threading.Thread(target=lambda: out.append(rule_score("\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(30)
    assert out and out[0].score == 1.0, out

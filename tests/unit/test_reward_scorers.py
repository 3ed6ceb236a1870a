"""Unit tests of the pure parts of the reward scorers and of `reward:` config validation."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlslurm.configfile import load_mapping
from rlslurm.errors import ConfigError
from rlslurm.reward.answers import extract_answer, normalise_number
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.math_answers import rule_score
from rlslurm.reward.scorers import extract_code, parse_judge_reply


@pytest.mark.parametrize("text, number", [
    ("1,000", Fraction(1000)), (" -3.50 ", Fraction(-7, 2)), ("$12", Fraction(12)), ("1/2", Fraction(1, 2)),
    ("50%", Fraction(1, 2)), ("1e3", Fraction(1000)), ("19.", Fraction(19)), ("1 000", Fraction(1000)),
    ("abc", None), ("1,00", None), ("1/0", None),
])
def test_normalise_number(text, number):
    assert normalise_number(text) == number


@pytest.mark.parametrize("response, answer", [
    ("so the total is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("The answer is 7 apples", "7 apples"),
    ("work...\n#### 1,234", "1,234"),
    ("12 + 7 = 19", "19"),
    ("no digits here", None),
])
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize("response, reference, score", [
    ("19", "19", 1.0), (" 1 9 ", "19", 1.0), ("= 19.0", "19", 1.0), ("the answer is 1,000", "1000", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0), ("18", "19", 0.0), ("", "19", 0.0), ("answer: Paris", "paris", 1.0),
    ("12+7=20", "19", 0.0),
])
def test_rule_score(response, reference, score):
    assert rule_score(response, reference).score == score


def test_rule_format_regex_gates_the_score():
    assert rule_score("19", "19", format_regex=r"\\boxed\{").reason.startswith("format")
    assert rule_score("\\boxed{19}", "19", format_regex=r"\\boxed\{").score == 1.0


@pytest.mark.parametrize("reply, value", [
    ("SCORE: 7", 0.7), ("score = 10", 1.0), ("reasoning... SCORE: 3\nSCORE: 8", 0.8), ("Score:0", 0.0),
    ("looks good", None), ("SCORE: 11", None), ("SCORE: -1", None),
])
def test_parse_judge_reply(reply, value):
    assert parse_judge_reply(reply, 10.0) == value


def test_extract_code_takes_the_first_fence():
    assert extract_code("here:\n```python\ndef f():\n    return 1\n```\nmore") == "def f():\n    return 1\n"
    assert extract_code("def f(): return 1") == "def f(): return 1"


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"reward.sandbox.wall_s = 0.0 must be > 0"):
        load_mapping(RewardConfig, {"sandbox": {"wall_s": 0}}, source="job.yaml", key="reward")
    with pytest.raises(ConfigError, match=r"reward.endpoint is required when reward.scorer = 'judge'|endpoint"):
        load_mapping(RewardConfig, {"scorer": "judge"}, source="job.yaml", key="reward")
    with pytest.raises(ConfigError, match="format_regex"):
        load_mapping(RewardConfig, {"format_regex": "("}, source="job.yaml", key="reward")
    with pytest.raises(ConfigError, match="Valid keys"):
        load_mapping(RewardConfig, {"sandbox": {"cpu_seconds": 1}}, source="job.yaml", key="reward")


def test_rule_scorer_scores_the_arithmetic_task_exactly_as_its_own_rule():
    """The RL job hands the service normalize(text) and ANSWER_FORMAT (rlslurm/rl/scoring.py reward_config): every
    response the engines can write - any string over the tokenizer's alphabet - must score the same."""
    import random

    from rlslurm.tasks.arithmetic import ANSWER_FORMAT, Problem, normalize, score
    from rlslurm.tokenizer import ALPHABET

    rng = random.Random(0)
    problems = [Problem(19, "+", 0), Problem(7, "-", 7), Problem(99, "+", 99)]
    tricky = ["19", " 1 9 ", "019", "+19", "- 19", "-19", "19=", "=19", "19+", "19+0", "1 9 9", "", " ",
              "-0", "- 0", "+ 0", "0", "00", "198", "+-19", "--0", "2 -", "1e3"]
    responses = tricky + ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    for problem in problems:
        for text in responses:
            want = score(problem, text)
            got = rule_score(normalize(text), problem.target, ANSWER_FORMAT).score
            assert got == want, (problem, text, got, want)
    assert sum(score(p, t) for p in problems for t in responses) >= 6  # the table holds right answers too


def test_rule_scorer_scores_lenient_answers_as_the_task_does():
    """task.answer = lenient (a chat model's prose): the service is handed answer_text(text, "lenient") with
    ANSWER_FORMAT and must score every response as score(..., "lenient") does."""
    import random

    from rlslurm.tasks.arithmetic import ANSWER_FORMAT, Problem, answer_text, score

    rng = random.Random(0)
    problems = [Problem(12, "+", 7), Problem(7, "-", 7)]
    tricky = ["12 + 7 = 19", "The answer is 19.", "19", "= 019", "=+19", "7 - 7 = 0", "0", "-0", "none", "",
              "= -19", "=", "12 = 19 = 20", "x19y", "19</s>"]
    alphabet = "0123456789+-= abc.\n"
    responses = tricky + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(3000)]
    for problem in problems:
        for text in responses:
            want = score(problem, text, "lenient")
            got = rule_score(answer_text(text, "lenient"), problem.target, ANSWER_FORMAT).score
            assert got == want, (problem, text, got, want)
    assert sum(score(p, t, "lenient") for p in problems for t in responses) >= 6

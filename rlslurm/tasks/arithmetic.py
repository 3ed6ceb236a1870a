"""The arithmetic task: generated problems ("12+7=" -> "19"), disjoint splits, and the scoring rule.

    train, held_out = make_splits(job.task)
    score(train[0], "19")      # 1.0 or 0.0
    score(train[0], "12 + 7 = 19", answer="lenient")   # 1.0: a chat model's prose (task.answer)

Problems are every (a, op, b) with operands in 0..max_operand (subtraction only where a >= b, so each
answer is a non-negative integer), shuffled by `task.seed`; train takes the first `train_size`, held-out
the next `eval_size`. The same seed gives the same splits on every rank, run and requeue.

`score` is the one verifiable rule: SFT evaluation and the inline RL reward call it; the reward service's
rule scorer gives the same score when handed `normalize(response)` and ANSWER_FORMAT (rlslurm/rl/controller.py does).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rlslurm.tasks.config import TaskConfig
from rlslurm.tokenizer import SPECIALS

ANSWER_FORMAT = r"^[+-]?\d+$"
"""The one form `score` accepts, on `normalize`d text: the reward service's rule scorer, handed the normalized
response and this as `reward.format_regex`, then scores exactly as `score` does (tests/unit/test_task.py)."""
_INTEGER = re.compile(ANSWER_FORMAT)
_ANY_INTEGER = re.compile(r"[+-]?\d+")
_PROMPT = re.compile(r"^(\d+)([+-])(\d+)=$")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: `prompt` is what the model sees, `target` the exact completion to learn."""

    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def prompt(self) -> str:
        return format_prompt(self.a, self.op, self.b)

    @property
    def target(self) -> str:
        return str(self.answer)


def format_prompt(a: int, op: str, b: int) -> str:
    """The prompt text of one problem; no spaces, so one character is one token."""
    return f"{a}{op}{b}="


def parse_prompt(prompt: str) -> Problem:
    """The problem behind a `format_prompt` text ("12+7=" -> Problem(12, "+", 7)); ValueError otherwise."""
    m = _PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"{prompt!r} is not an arithmetic task prompt (like '12+7=')")
    return Problem(int(m.group(1)), m.group(2), int(m.group(3)))


def all_problems(max_operand: int, operations: tuple[str, ...]) -> list[Problem]:
    """Every distinct problem in a fixed order (the order the shuffle starts from)."""
    out = []
    for op in sorted(set(operations)):
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and a < b:
                    continue
                out.append(Problem(a, op, b))
    return out


def make_splits(task: TaskConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out): deterministic from task.seed, disjoint by construction."""
    problems = _shuffled(task)
    train = problems[: task.train_size]
    held_out = problems[task.train_size : task.train_size + task.eval_size]
    return train, held_out


def make_dev(task: TaskConfig) -> list[Problem]:
    """The dev split (task.dev_size problems after train and held-out): what decides when SFT stops."""
    start = task.train_size + task.eval_size
    return _shuffled(task)[start : start + task.dev_size]


def _shuffled(task: TaskConfig) -> list[Problem]:
    problems = all_problems(task.max_operand, task.operations)
    # random.Random(seed).shuffle is stable across Python versions for an int seed, so splits written
    # down today are the splits a requeued job regenerates tomorrow.
    random.Random(task.seed).shuffle(problems)
    return problems


def normalize(response: str) -> str:
    """The response as the scorer reads it: special-token text removed, whitespace dropped."""
    for token in SPECIALS:
        response = response.replace(token, "")
    return "".join(response.split())


def parse_answer(response: str) -> int | None:
    """The integer a response states, or None when it is not exactly one integer."""
    text = normalize(response)
    return int(text) if _INTEGER.fullmatch(text) else None


def parse_answer_lenient(response: str) -> int | None:
    """The integer a chatty response states: the first one after its first '=' ("12 + 7 = 19, since..."),
    else its first one ("The answer is 19."); None when there is none. Read from the raw text, not the
    `normalize`d one: dropping spaces would glue "= 19 20" into 1920."""
    for token in SPECIALS:
        response = response.replace(token, "")
    head, eq, tail = response.partition("=")
    m = _ANY_INTEGER.search(tail if eq else head)
    return int(m.group()) if m else None


def answer_text(response: str, answer: str = "exact") -> str:
    """The response as the reward service's rule scorer is handed it (with ANSWER_FORMAT): `normalize`d for
    task.answer = exact; for lenient the integer it states, or the normalized text when it states none (which
    then fails the format, as `score` gives 0.0)."""
    if answer == "lenient":
        value = parse_answer_lenient(response)
        return str(value) if value is not None else normalize(response)
    return normalize(response)


def score(problem: Problem, response: str, answer: str = "exact") -> float:
    """1.0 when the response states the answer, else 0.0. exact (task.answer's default): the response is
    exactly the answer after normalisation ("019", " 19 </s>" count); lenient: `parse_answer_lenient`."""
    stated = parse_answer_lenient(response) if answer == "lenient" else parse_answer(response)
    return 1.0 if stated == problem.answer else 0.0

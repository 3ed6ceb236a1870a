"""`task:` in a job YAML: the built-in verifiable task and its generated splits."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import FieldError, check, check_range, check_text


def distinct_problems(max_operand: int, operations: tuple[str, ...]) -> int:
    """How many different problems the generator can make (subtraction keeps answers >= 0)."""
    n = max_operand + 1
    counts = {"+": n * n, "-": n * (n + 1) // 2}
    return sum(counts[op] for op in set(operations))


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    name: Literal["arithmetic"] = "arithmetic"
    """The built-in task: arithmetic = short sums with exact integer answers."""
    max_operand: int = 99
    """Largest operand of generated problems (operands are 0..max_operand; every problem is generated, so at
    most ~1.5 million of them). Range [1, 999]."""
    operations: tuple[Literal["+", "-"], ...] = ("+", "-")
    """Operators problems use; '-' only as a - b with a >= b, so every answer is a non-negative integer."""
    train_size: int = 2000
    """Generated training problems. Range [1, 1000000]."""
    eval_size: int = 200
    """Generated held-out problems (disjoint from train). Range [1, 1000000]."""
    dev_size: int = 0
    """Generated problems that decide when SFT stops (train.stop_at_accuracy), disjoint from train and
    held-out, so the held-out number is never the one a run was stopped on; 0 = none. Range [0, 1000000]."""
    seed: int = 1234
    """Seed of the data generator: the same seed gives the same splits on every rank and every run.
    Range [0, 4294967295]."""
    prompt_style: Literal["plain", "chat"] = "plain"
    """plain = the model sees the bare prompt ("12+7=", the embedded model's SFT format); chat = the problem,
    phrased by `chat_question`, as one user message through the model's own chat template (a pretrained
    instruct model, e.g. examples/smollm2-grpo.yaml). See rlslurm/tasks/prompts.py."""
    chat_question: str = "What is {a} {op} {b}? Answer with the number only."
    """The user message of prompt_style = chat; {a}, {op} and {b} are the problem's operands and operator
    (plain fields, no format spec); at most 2000 characters."""
    answer: Literal["exact", "lenient"] = "exact"
    """How a response is read: exact = the whole response must be the integer (after whitespace and special
    tokens are dropped); lenient = the first integer after the first '=', or the first integer when there is
    no '=' ("12 + 7 = 19", "The answer is 19." both state 19): what a chat model's prose needs."""

    def __post_init__(self):
        check_range(self.max_operand, "max_operand", 1, 999)
        check(len(self.operations) >= 1, "operations", "must name at least one of '+', '-'")
        for name in ("train_size", "eval_size"):
            check_range(getattr(self, name), name, 1, 1_000_000, note="problems")
        check_range(self.dev_size, "dev_size", 0, 1_000_000, note="problems")
        check_range(self.seed, "seed", 0, 2**32 - 1)
        check_text(self.chat_question, "chat_question", 2000, lines=True)
        total = distinct_problems(self.max_operand, self.operations)
        dev = f" + task.dev_size = {self.dev_size}" if self.dev_size else ""
        check(self.train_size + self.eval_size + self.dev_size <= total, "train_size",
              f"+ task.eval_size = {self.eval_size}{dev} exceeds the {total} distinct problems that "
              f"task.max_operand = {self.max_operand} and task.operations = {list(self.operations)} allow "
              f"(the splits must be disjoint)")
        try:
            fields = [(spec, conv) for _, name, spec, conv in string.Formatter().parse(self.chat_question)
                      if name is not None]
        except ValueError as e:
            raise FieldError("chat_question", f"may name only {{a}}, {{op}} and {{b}} (ValueError: {e})") from None
        # Refused before formatting: {a:>999999999} would build a gigabyte string.
        check(not any(spec or conv for spec, conv in fields), "chat_question",
              "may name only {a}, {op} and {b}, as plain fields (no format spec or conversion such as {a:>9})")
        try:
            self.chat_question.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as e:
            raise FieldError("chat_question",
                             f"may name only {{a}}, {{op}} and {{b}} ({type(e).__name__}: {e})") from None

"""`task:` in a job YAML: the built-in verifiable task and its generated splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import FieldError, check


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
    """Largest operand of generated problems (operands are 0..max_operand)."""
    operations: tuple[Literal["+", "-"], ...] = ("+", "-")
    """Operators problems use; '-' only as a - b with a >= b, so every answer is a non-negative integer."""
    train_size: int = 2000
    """Generated training problems."""
    eval_size: int = 200
    """Generated held-out problems (disjoint from train)."""
    seed: int = 1234
    """Seed of the data generator: the same seed gives the same splits on every rank and every run."""
    prompt_style: Literal["plain", "chat"] = "plain"
    """plain = the model sees the bare prompt ("12+7=", the embedded model's SFT format); chat = the problem,
    phrased by `chat_question`, as one user message through the model's own chat template (a pretrained
    instruct model, e.g. examples/smollm2-grpo.yaml). See rlslurm/tasks/prompts.py."""
    chat_question: str = "What is {a} {op} {b}? Answer with the number only."
    """The user message of prompt_style = chat; {a}, {op} and {b} are the problem's operands and operator."""
    answer: Literal["exact", "lenient"] = "exact"
    """How a response is read: exact = the whole response must be the integer (after whitespace and special
    tokens are dropped); lenient = the first integer after the first '=', or the first integer when there is
    no '=' ("12 + 7 = 19", "The answer is 19." both state 19): what a chat model's prose needs."""

    def __post_init__(self):
        check(self.max_operand >= 1, "max_operand", "must be >= 1")
        check(len(self.operations) >= 1, "operations", "must name at least one of '+', '-'")
        check(self.train_size >= 1, "train_size", "must be >= 1")
        check(self.eval_size >= 1, "eval_size", "must be >= 1")
        total = distinct_problems(self.max_operand, self.operations)
        check(self.train_size + self.eval_size <= total, "train_size",
              f"+ task.eval_size = {self.eval_size} exceeds the {total} distinct problems that "
              f"task.max_operand = {self.max_operand} and task.operations = {list(self.operations)} allow "
              f"(the splits must be disjoint)")
        try:
            self.chat_question.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as e:
            raise FieldError("chat_question", f"may name only {{a}}, {{op}} and {{b}} ({type(e).__name__}: {e})") from None

"""How a task prompt reaches a model and how its answer is read back: plain (the embedded model) or chat.

    fmt = PromptFormat(job.task, tokenizer)      # the tokenizer of the model the engines serve
    fmt.text("12+7=")      # what the engine is sent: the prompt itself, or the model's chat template around
                           # task.chat_question
                           # ("<|im_start|>user\\nWhat is 12 + 7? ...<|im_end|>\\n<|im_start|>assistant\\n")
    fmt.encode("12+7=")    # its token ids, as the trainer scores them (the engine encodes the same text alike)
    fmt.score(problem, response), fmt.answer_text(response)
    PromptFormat(job.task, tokenizer, data=True).text(messages)   # a user's row: text as is, messages through
                                                                  # the model's chat template (data/tokens.py)

The RL controller keeps task prompts ("12+7=") everywhere (data, reward items, logs) and asks this class
only at the two edges: the text an engine generates from, and the rule a response is scored by. The
plain style is exactly the embedded path (the prompt as is, `score` exact): examples/tiny-grpo.yaml trains
bit for bit as before.

Why the trainer re-encodes the text instead of taking the engine's ids: both load the tokenizer from the
same model directory and encode the same string, so the ids agree (Policy.update measures it: the
engine/trainer logprob gap); the template's special tokens (<|im_start|>) are written as text and the fast
tokenizer maps them to their single ids on both sides.
"""

from __future__ import annotations

from rlslurm.data.tokens import prompt_text
from rlslurm.errors import ConfigError
from rlslurm.tasks.arithmetic import Problem, answer_text, parse_prompt, score
from rlslurm.tasks.config import TaskConfig


class PromptFormat:
    """task.prompt_style and task.answer applied with one model's tokenizer."""

    def __init__(self, task: TaskConfig, tokenizer, *, model_dir: object = None, data: bool = False):
        # data: the prompts are a user's rows (data.train), not task prompts; task.prompt_style does not apply
        self.task, self.tokenizer, self.data = task, tokenizer, data
        if not data and task.prompt_style == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"task.prompt_style = chat, but the tokenizer of {model_dir or 'the model'} has no "
                              "chat template; use task.prompt_style = plain, or a model exported with one "
                              "(python -m rlslurm.models.smollm2 --out DIR)")
        self._texts: dict[str, str] = {}

    def text(self, prompt) -> str:
        """The text an engine generates from for task prompt `prompt` (cached: the template is Jinja), or for a
        data row's prompt (text, or messages)."""
        if self.data:
            return prompt_text(self.tokenizer, prompt)
        if self.task.prompt_style == "plain":
            return prompt
        text = self._texts.get(prompt)
        if text is None:
            p = parse_prompt(prompt)
            question = self.task.chat_question.format(a=p.a, op=p.op, b=p.b)
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                      add_generation_prompt=True)
            self._texts[prompt] = text
        return text

    def encode(self, prompt) -> list[int]:
        """Token ids of `text(prompt)`, as an engine encodes it."""
        return list(self.tokenizer(self.text(prompt))["input_ids"])

    def score(self, problem: Problem, response: str) -> float:
        """The task's rule under task.answer."""
        return score(problem, response, self.task.answer)

    def answer_text(self, response: str) -> str:
        """What the reward service's rule scorer is handed for `response` (scores as `score` does)."""
        return answer_text(response, self.task.answer)

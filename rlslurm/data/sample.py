"""One training or evaluation row as both entrances see it, whatever file or layout it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

Messages = list[dict]
"""A conversation: [{"role": "user" | "assistant" | "system" | "tool", "content": "...", ...}, ...] (tool turns and
an assistant's tool_calls: rlslurm/data/messages.py)."""


@dataclass(frozen=True)
class Sample:
    """A row: `prompt` is what the model is given (text, or messages rendered by the model's chat template),
    `completion` what SFT teaches it to answer (text; None where the row has none), `reference` the ground truth
    a reward compares with, `tests` a code problem's tests, `extra` every other column, `row` its index in
    its split (0-based, as `datasets` counts); `turns` the assistant and tool turns of a tool-using conversation
    after its prompt (SFT learns every assistant turn of them; None for any other row)."""

    prompt: Union[str, Messages]
    completion: str | None = None
    reference: Any = None
    tests: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    row: int = 0
    turns: Messages | None = None

    @property
    def is_chat(self) -> bool:
        """Whether the prompt is a conversation (rendered through a chat template) rather than plain text."""
        return isinstance(self.prompt, list)

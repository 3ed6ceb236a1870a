"""The pieces of a chat template an RL episode appends around the model's own tokens, turn by turn.

    template = TurnTemplate(tokenizer, tools)          # RL (rlslurm/rl/episodes.py)
    template.prompt_ids(messages)                      # the prompt, the assistant's turn opened
    template.between_turns(results, ended_with_eos)    # ids after a model turn: the template's end of that turn,
                                                       # the tool turns, the next assistant turn opened

One rule with SFT's (rlslurm/data/tokens.py encode_turns): a conversation is rendered after each message and the
text it grew by is that message's piece; a model turn's piece is the model's up to and including the end-of-turn
token (</s>, <|im_end|>), the rest of it (Qwen's newline after <|im_end|>) is the template's, as are the tool
turns and the generation prompt.
Each piece is tokenised on its own, so what the model generated in an episode is never decoded and encoded
again: the engine's ids stay, only the template's pieces between them are encoded (as verl's agent loop does).
That needs a template that renders a conversation as a prefix of its continuation: a template that rewrites
earlier turns (one that drops the reasoning of past turns) is refused with the message saying so.
"""

from __future__ import annotations

from rlslurm.data.layout import DataError
from rlslurm.data.sample import Messages
from rlslurm.data.tokens import grown, ids_of, render

_BASE = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
"""A conversation the between-turn pieces are cut from: any short question and answer renders them alike."""



class TurnTemplate:
    """The pieces of a chat template an RL episode needs around the model's own tokens, for one model and one
    set of tool schemas (`tools`, shown to the model the template's way, e.g. Qwen's system prompt)."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None
        opened = render(tokenizer, _BASE[:1], self.tools, generation=True)
        self._answered = render(tokenizer, _BASE, self.tools)
        after_content = grown(opened, self._answered, "the assistant's turn")
        if not after_content.startswith(_BASE[1]["content"]):
            raise DataError("the model's chat template does not write an assistant turn's content right after the "
                            "generation prompt; a tool-using job needs one that does")
        end = after_content[len(_BASE[1]["content"]):]
        eos = tokenizer.eos_token or ""
        self.end_of_turn = end
        """The template's text after a model turn's content: its end-of-turn token and what follows it."""
        self.after_eos = end[len(eos):] if eos and end.startswith(eos) else end
        """What the template writes after the end-of-turn token the model generated itself (Qwen: a newline)."""

    def prompt_ids(self, prompt) -> list[int]:
        """The ids of a prompt: messages through the template with the assistant's turn opened; text as it is,
        with the tokenizer's special tokens (BOS) as an engine encodes it."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return ids_of(self.tokenizer, render(self.tokenizer, prompt, self.tools, generation=True))

    def between_turns(self, results: Messages, ended_with_eos: bool) -> list[int]:
        """The ids after a model turn that called tools: the rest of the template's end of that turn, the tool
        turns `results` ({"role": "tool", "name", "content"}), the next assistant turn opened."""
        text = render(self.tokenizer, _BASE + list(results), self.tools, generation=True)
        tail = self.after_eos if ended_with_eos else self.end_of_turn
        return ids_of(self.tokenizer, tail + grown(self._answered, text, "the tool turns"))

"""Samples as token ids: the prompt (text, or messages through the model's chat template) and the completion
learned after it, and what happens to a row longer than the model's positions.

    ids, labels = encode(tokenizer, sample)      # labels: IGNORE on the prompt, the completion + </s> learned
                                                 # (a tool-using conversation: every assistant turn, turn by turn)
    fit((ids, labels), max_positions, "drop")    # as is, cut (truncate), or None (dropped)
    collate([(ids, labels), ...])                # right-padded input_ids, labels, attention_mask
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlslurm.data.layout import DataError
from rlslurm.data.sample import Messages, Sample
from rlslurm.errors import ConfigError
from rlslurm.tokenizer import PAD_ID

if TYPE_CHECKING:  # `rlslurm submit` and `validate` read rows through this module, and need no torch
    import torch

IGNORE = -100
"""Label value the HF loss skips: prompt and padding positions."""


def job_tokenizer(job):
    """The tokenizer the job's SFT rows are encoded with: the embedded character tokenizer (with its chat
    template for a user's dataset), or, for a user's dataset on a model loaded from train.init_from, that
    model's own."""
    from rlslurm.tokenizer import build_tokenizer

    if job.data.train is not None and job.train.init_from:
        from pathlib import Path

        from transformers import AutoTokenizer

        if not (Path(job.train.init_from) / "tokenizer_config.json").is_file():
            raise ConfigError(f"train.init_from = {job.train.init_from!r}: no model directory with a tokenizer there "
                              f"(tokenizer_config.json), which encodes data.train's rows; point it at an HF model "
                              f"directory (an SFT run's <run>/export/hf)")
        return AutoTokenizer.from_pretrained(job.train.init_from, local_files_only=True)
    return build_tokenizer(chat=job.data.train is not None)


def chat_template(tokenizer) -> str:
    """The template a chat prompt is rendered with: the tokenizer's own, or the embedded model's CHAT_TEMPLATE
    (an exported embedded model's tokenizer files carry none: the arithmetic task needs none)."""
    from rlslurm.tokenizer import CHAT_TEMPLATE, is_embedded

    template = getattr(tokenizer, "chat_template", None) or (CHAT_TEMPLATE if is_embedded(tokenizer) else None)
    if not template:
        raise ConfigError("the data holds chat messages, but the model's tokenizer has no chat template; use "
                          "text prompts (data.layout = trl_prompt_completion) or a model with a chat template")
    return template


def prompt_ids(tokenizer, sample: Sample) -> list[int]:
    """Token ids of the prompt as the model is given it (a chat prompt with the assistant's turn opened)."""
    if sample.is_chat:
        return list(tokenizer.apply_chat_template(sample.prompt, chat_template=chat_template(tokenizer),
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    return list(tokenizer(sample.prompt)["input_ids"])


def prompt_text(tokenizer, prompt) -> str:
    """The text a rollout engine is sent for a row's prompt (text as is; messages through the chat template),
    such that the engine's encoding of it, tokenizer(text) with its special tokens, is `prompt_ids`: a template
    that writes the BOS itself (the embedded one) would get a second one from the encoding, so it is cut."""
    if isinstance(prompt, str):
        return prompt
    text = tokenizer.apply_chat_template(prompt, chat_template=chat_template(tokenizer), add_generation_prompt=True,
                                         tokenize=False)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


def encode(tokenizer, sample: Sample) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one row; only the completion and </s> are learned (a tool-using conversation:
    every assistant turn, `encode_turns`)."""
    if sample.turns:
        return encode_turns(tokenizer, sample)
    prompt = prompt_ids(tokenizer, sample)
    target = tokenizer(sample.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + target, [IGNORE] * len(prompt) + target


def render(tokenizer, messages: Messages, tools: list[dict] | None = None, *, generation: bool = False) -> str:
    """The chat template's text of `messages` (with the assistant's next turn opened when `generation`)."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, chat_template=chat_template(tokenizer), tokenize=False,
                                         add_generation_prompt=generation, **kwargs)


def ids_of(tokenizer, text: str) -> list[int]:
    """Token ids of a piece of rendered text: its special tokens as written, none added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def grown(before: str, after: str, what: str) -> str:
    if not after.startswith(before):
        raise DataError(f"the model's chat template does not render the conversation turn by turn: the text "
                        f"after {what} does not begin with the text before it, so the tokens of a turn would "
                        "change once later turns exist; a tool-using job needs a template that only appends "
                        f"(before ends {before[-60:]!r}, after it {after[len(before) - 60:len(before) + 20]!r})")
    return after[len(before):]


def learned_part(piece: str, eos: str | None) -> tuple[str, str]:
    """(learned, given) of a model turn's piece: up to and including its end-of-turn token, and the rest."""
    cut = piece.find(eos) if eos else -1
    return (piece, "") if cut < 0 else (piece[:cut + len(eos)], piece[cut + len(eos):])


def encode_turns(tokenizer, sample: Sample) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a tool-using conversation: every assistant turn after the prompt is learned (its
    tool calls as the template writes them, and its end-of-turn token), the rest is IGNORE."""
    tools = (sample.extra or {}).get("tools")
    messages = list(sample.prompt) + list(sample.turns or [])
    text = render(tokenizer, sample.prompt, tools, generation=True)
    ids = ids_of(tokenizer, text)
    labels = [IGNORE] * len(ids)
    for j in range(len(sample.prompt), len(messages)):
        opens_next = j + 1 < len(messages) and messages[j + 1]["role"] == "assistant"
        after = render(tokenizer, messages[:j + 1], tools, generation=opens_next)
        piece = grown(text, after, f"message {j} ({messages[j]['role']})")
        text = after
        learned, given = learned_part(piece, tokenizer.eos_token) if messages[j]["role"] == "assistant" else ("", piece)
        for part, learn in ((learned, True), (given, False)):
            part_ids = ids_of(tokenizer, part)
            ids += part_ids
            labels += part_ids if learn else [IGNORE] * len(part_ids)
    return ids, labels


def fit(example: tuple[list[int], list[int]], max_positions: int, too_long: str) -> tuple[list[int], list[int]] | None:
    """`example` within the model's positions: as is, cut to them (too_long = truncate, while a learned token
    is left), or None (dropped)."""
    ids, labels = example
    if len(ids) <= max_positions:
        return example
    if too_long == "truncate" and any(t != IGNORE for t in labels[:max_positions]):
        return ids[:max_positions], labels[:max_positions]
    return None


def collate(examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad a batch of (ids, labels) for the trainer; padding sits after every real token, so causal
    attention never sees it."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)], labels[row, : len(y)], mask[row, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}

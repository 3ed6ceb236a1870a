"""Samples as token ids: the prompt (text, or messages through the model's chat template) and the completion
learned after it, and what happens to a row longer than the model's positions.

    ids, labels = encode(tokenizer, sample)      # labels: IGNORE on the prompt, the completion + </s> learned
    fit((ids, labels), max_positions, "drop")    # as is, cut (truncate), or None (dropped)
    collate([(ids, labels), ...])                # right-padded input_ids, labels, attention_mask
"""

from __future__ import annotations

import torch

from rlslurm.data.sample import Sample
from rlslurm.errors import ConfigError
from rlslurm.tokenizer import PAD_ID

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
    """(input ids, labels) of one row; only the completion and </s> are learned."""
    prompt = prompt_ids(tokenizer, sample)
    target = tokenizer(sample.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + target, [IGNORE] * len(prompt) + target


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
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)], labels[row, : len(y)], mask[row, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}

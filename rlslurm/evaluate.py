"""Greedy held-out accuracy of a causal LM on task problems, scored by the task's own rule.

    result = greedy_accuracy(model, tokenizer, held_out, max_new_tokens=8)
    result.accuracy, result.correct, result.total

Prompts are batched by token length, so no batch holds padding: each answer is exactly what an engine
that decodes one prompt at a time (vLLM, the HF rollout engine) would produce, and the number an SFT run
records is the number anyone who loads its export measures again.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from rlslurm.tasks.arithmetic import Problem, score


@dataclass(frozen=True)
class EvalResult:
    """Held-out accuracy and the answers behind it."""

    correct: int
    total: int
    responses: list[str] = field(repr=False, default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


@torch.no_grad()
def greedy_responses(model, tokenizer, prompts: list[str], max_new_tokens: int,
                     batch_size: int = 128) -> list[str]:
    """The greedy completion of each prompt (special tokens dropped), in the order given."""
    model = getattr(model, "module", model)  # unwrap DistributedDataParallel
    was_training = model.training
    model.eval()
    by_length: dict[int, list[int]] = defaultdict(list)
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    out: list[str] = [""] * len(prompts)
    try:
        for length, indices in sorted(by_length.items()):
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                input_ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long, device=model.device)
                generated = model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                    do_sample=False, max_new_tokens=max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                )
                for i, row in zip(chunk, generated[:, length:].tolist()):
                    out[i] = tokenizer.decode(row, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out


def greedy_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int,
                    batch_size: int = 128) -> EvalResult:
    """Share of `problems` whose greedy completion scores 1.0 under the task's rule."""
    responses = greedy_responses(model, tokenizer, [p.prompt for p in problems], max_new_tokens, batch_size)
    correct = sum(int(score(p, r)) for p, r in zip(problems, responses))
    return EvalResult(correct=correct, total=len(problems), responses=responses)

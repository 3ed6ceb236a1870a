"""How an SFT run is judged: the dev-split target that stops it (train.stop_at_accuracy) and the held-out result
of its export (greedy accuracy on the task, completion loss on a user's rows), both for jobs/sft.py's loop.

    stop = StopAtTarget(job, metrics, tokenizer); stop.reached(state, guard)     # every step boundary
    record = evaluate_export(job, metrics, step, export, model, tokenizer, held_out, started)
"""

from __future__ import annotations

import time

import torch

from rlslurm.config import JobConfig
from rlslurm.data.layout import RowError
from rlslurm.data.table import SampleTable
from rlslurm.data.tokens import IGNORE, collate, encode, fit
from rlslurm.diag.guard import PhaseGuard
from rlslurm.evaluate import greedy_accuracy
from rlslurm.metrics_sinks import MetricsLog
from rlslurm.tasks.arithmetic import make_dev, parse_prompt


class StopAtTarget:
    """train.stop_at_accuracy: every train.eval_every_steps, rank 0 decodes the dev split greedily and the run
    stops once its accuracy reaches the target.

    Why a target and not a step count: the embedded recipe's learning curve is steep where SFT should leave
    room for RL (0.15 -> 0.62 held-out in 300 steps), and where a given step lands on it moves by hundreds
    of steps with the CPU's kernel path (ATEN_CPU_CAPABILITY) and the seed: 850 steps gave 0.09 on one
    machine and 0.37 on another. The stop decision is a pure function of the weights, so a run resumed from
    the checkpoint it stopped at decides the same again. The dev split is disjoint from held-out: the
    held-out number is never the one the run was stopped on.
    """

    def __init__(self, job: JobConfig, metrics: MetricsLog, tokenizer):
        self.job, self.metrics, self.tokenizer = job, metrics, tokenizer
        self.dev = make_dev(job.task) if job.train.stop_at_accuracy is not None else []

    def reached(self, state, guard: PhaseGuard) -> bool:
        """Collective when an evaluation is due (every rank calls it at each step boundary)."""
        train = self.job.train
        if not self.dev or state.step == 0 or state.step % train.eval_every_steps:
            return False
        with guard.phase("eval", step=state.step):
            model = state.eval_model()
            if model is None:
                return False  # rank 0 decides; the step boundary's all-reduce carries its answer
            t0 = time.perf_counter()
            result = greedy_accuracy(model, self.tokenizer, self.dev, max_new_tokens=self.job.rollout.max_new_tokens)
            self.metrics.append({
                "t": time.time(), "kind": "sft_dev", "step": state.step, "dev_accuracy": result.accuracy,
                "target": train.stop_at_accuracy, "eval_s": time.perf_counter() - t0})
        return result.accuracy >= train.stop_at_accuracy


def evaluate_export(job, metrics, step, export, model, tokenizer, held_out: SampleTable, started) -> dict:
    """Rank 0 after the export: the held-out result in metrics.jsonl (`sft_eval`): greedy accuracy on the task,
    completion loss on a user's rows."""
    if job.data.train is None:
        problems = [parse_prompt(s.prompt) for s in held_out.samples()]
        result = greedy_accuracy(model, tokenizer, problems, max_new_tokens=job.rollout.max_new_tokens)
        record = {"held_out_accuracy": result.accuracy, "held_out_correct": result.correct,
                  "held_out_total": result.total}
    else:
        record = held_out_loss(job, model, tokenizer, held_out)
    record.update({"export": str(export), "wall_s": time.time() - started})
    metrics.append({"t": time.time(), "kind": "sft_eval", "step": step, **record})
    return record


HELD_OUT_ROWS = 256
"""Held-out rows a data SFT run scores its export's completion loss on (the first ones of data.eval)."""


@torch.no_grad()
def held_out_loss(job: JobConfig, model, tokenizer, held_out: SampleTable) -> dict:
    """Mean completion-token loss of the trained model on the first HELD_OUT_ROWS held-out rows that fit."""
    model = getattr(model, "module", model)
    was_training = model.training
    model.eval()
    total, tokens, rows = 0.0, 0, 0
    try:
        for i in range(min(len(held_out), HELD_OUT_ROWS)):
            sample = held_out.try_sample(i)
            if isinstance(sample, RowError):
                continue
            example = fit(encode(tokenizer, sample), job.model.max_positions, job.data.too_long)
            if example is None:
                continue
            batch = collate([example])
            n = int((batch["labels"][:, 1:] != IGNORE).sum())
            out = model(**{k: v.to(model.device) for k, v in batch.items()})
            total, tokens, rows = total + float(out.loss) * n, tokens + n, rows + 1
    finally:
        model.train(was_training)
    return {"held_out_loss": total / tokens if tokens else None, "held_out_rows": rows, "held_out_tokens": tokens}

"""train.lora in the plan (rlslurm/plan/lora.py): the adapter count is PEFT's own, the frozen base holds no
gradient, optimizer state or DDP bucket, a step's sync moves the adapters (the bytes a LoRA run measured), and
the train step skips the frozen weights' gradients.

    python -m pytest -q tests/unit/test_plan_lora.py      # ~5 s
"""

from __future__ import annotations

import dataclasses

import pytest

from rlslurm.config import JobConfig
from rlslurm.lora import LoraConfig, inject
from rlslurm.modelspec import ModelConfig, param_counts
from rlslurm.plan.lora import adapter_params
from rlslurm.plan.memory import resolve, trainer_memory
from rlslurm.plan.report import build_plan
from rlslurm.tinymodel import build_model


def _lora_job(rank: int = 8, **rollout) -> JobConfig:
    job = JobConfig()
    return dataclasses.replace(job, train=dataclasses.replace(job.train, lora=LoraConfig(rank=rank)),
                               rollout=dataclasses.replace(job.rollout, **rollout))


@pytest.mark.parametrize("model", [JobConfig().model, ModelConfig(layers=3, hidden=64, heads=4, kv_heads=2,
                                                                  ffn_hidden=96, vocab=40)])
@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj")])
def test_the_adapter_count_is_peft_s(model, targets):
    lora = LoraConfig(rank=4, **({"targets": targets} if targets else {}))
    injected = inject(build_model(model, seed=0), lora)
    trainable = sum(p.numel() for p in injected.parameters() if p.requires_grad)
    assert adapter_params(model, lora) == trainable > 0


def test_the_frozen_base_holds_no_gradient_optimizer_state_or_bucket():
    job = JobConfig()
    counts, memory = param_counts(job.model), resolve(job.memory, "torch", "cpu")
    n = adapter_params(job.model, LoraConfig(rank=8))
    full = trainer_memory(counts, job.model, job.parallel, memory, 96.0, 2, backend="torch")
    lora = trainer_memory(counts, job.model, job.parallel, memory, 96.0, 2, backend="torch", adapters=n)
    gb = 1e-9
    assert lora.grads.value == pytest.approx(n * 4 * gb) and lora.dense_optimizer.value == pytest.approx(n * 8 * gb)
    assert lora.buckets.value == pytest.approx(n * 4 * gb) and lora.expert_optimizer.value == 0
    assert lora.weights.value == pytest.approx(full.weights.value + n * 4 * gb)
    # full: 4 + 4 + 8 + 4 B per parameter; LoRA: the base weights, and 4 + 4 + 8 + 4 B per adapter parameter
    assert full.resident.value - lora.resident.value == pytest.approx((16 * counts.total - 20 * n) * gb, rel=1e-6)
    assert lora.peak.value < full.peak.value


def test_a_steps_sync_moves_the_adapters_and_the_train_step_is_lighter():
    n = adapter_params(JobConfig().model, LoraConfig(rank=8))
    assert n * 4 == 94208  # the sync_update_bytes a LoRA rank 8 GRPO run of the embedded default measured
    plain, lora, vllm = build_plan(JobConfig()), build_plan(_lora_job()), build_plan(_lora_job(engine="vllm"))
    for method, q in lora.syncs.items():
        assert q.value < plain.syncs[method].value
    assert lora.syncs["disk"].value == pytest.approx(94208 / 1e9 / JobConfig().hardware.fs_bandwidth_gb_s)
    assert vllm.syncs["disk"].value == plain.syncs["disk"].value  # vLLM is sent the merged model
    assert lora.chosen.train_step.value < plain.chosen.train_step.value
    assert "no frozen weight gradients" in lora.chosen.train_step.how

"""Each planner formula against a value worked by hand (or counted by transformers itself)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import transformers

from rlslurm.config import JobConfig
from rlslurm.configfile import FieldError
from rlslurm.modelspec import ModelConfig, param_counts, shape_counts
from rlslurm.plan.activations import activations
from rlslurm.plan.checkpoint_interval import checkpoint_interval
from rlslurm.plan.decode import capacity, kv_cache, roofline, weights_gb
from rlslurm.plan.hardware import HardwareConfig
from rlslurm.plan.memory import MemoryConfig, resolve, trainer_memory, verdict
from rlslurm.plan.parallel import ParallelConfig, rollout_rules, static_rules, world_rules
from rlslurm.plan.quantity import Q
from rlslurm.plan.steptime import TimingConfig, amortise, reward_phase, sync_times, train_step_s
from rlslurm.reward.config import RewardConfig
from rlslurm.rl.config import RLConfig
from rlslurm.rollout.config import RolloutConfig


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_dense_count_equals_the_real_llama():
    m = ModelConfig(layers=3, hidden=48, heads=6, kv_heads=2, ffn_hidden=96, vocab=50, tie_embeddings=False)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    dense, expert, active = shape_counts(m)
    assert (dense, expert, active) == (_numel(transformers.LlamaForCausalLM(cfg)), 0, dense)


def test_moe_count_equals_the_real_mixtral():
    m = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=40, experts=4, topk=2,
                    expert_ffn_hidden=24, tie_embeddings=False)
    cfg = transformers.MixtralConfig(vocab_size=40, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, tie_word_embeddings=False)
    dense, expert, active = shape_counts(m)
    assert dense + expert == _numel(transformers.MixtralForCausalLM(cfg))
    assert expert == 2 * 4 * 3 * 32 * 24
    assert active == dense + 2 * 2 * 3 * 32 * 24


def test_overrides_win_and_are_named():
    m = ModelConfig(experts=4, topk=1, expert_params_b=8.0, dense_params_b=1.0)
    c = param_counts(m)
    assert (c.expert, c.dense, c.active) == (8e9, 1e9, 1e9 + 8e9 / 4)
    assert c.overridden == ("dense_params_b", "expert_params_b")


# Korthikanti et al.: per layer s b h (34 + 5 a s / h) none, 34 s b h selective, 2 s b h full; / t with SP.
SHAPE = ModelConfig(layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=32)


def _megatron(**memory) -> MemoryConfig:
    """memory: as the Megatron trainer resolves it on a GPU profile (bf16, distributed optimizer)."""
    return resolve(MemoryConfig(**memory), "megatron", "h20-96g")


@pytest.mark.parametrize("recompute,tp,expected_bytes", [
    ("none", 1, 2 * 128 * 2 * 64 * (34 + 5 * 4 * 128 / 64)),   # 2,424,832
    ("selective", 1, 2 * 128 * 2 * 64 * 34),                    # 1,114,112
    ("full", 1, 2 * 128 * 2 * 64 * 2),                          # 65,536
    ("selective", 2, 2 * 128 * 2 * 64 * 34 / 2),
])
def test_activation_formulas(recompute: str, tp: int, expected_bytes: float):
    p = ParallelConfig(seq_len=128, micro_batch_size=2, tp=tp)
    act = activations(SHAPE, p, _megatron(recompute=recompute, temporaries_gb=1.0), "megatron")
    assert act.layers.value == pytest.approx(expected_bytes / 1e9)
    logits = 2 * 128 * 32 * 4 * 2 / tp / 1e9
    assert act.logits.value == pytest.approx(logits)
    assert act.total.value == pytest.approx(expected_bytes / 1e9 + logits + 1.0)


def test_moe_mlp_activations_scale_with_topk_width():
    moe = dataclasses.replace(SHAPE, experts=8, topk=2, expert_ffn_hidden=64)  # 2 x 64 = 4h / 2: MLP 19 -> 9.5
    act = activations(moe, ParallelConfig(seq_len=128), _megatron(recompute="selective"), "megatron")
    assert act.layers.value == pytest.approx(2 * 128 * 64 * (15 + 9.5) / 1e9)


def test_calibrated_activations_and_fused_ce():
    mem = _megatron(activation_gb=47.5, logits_gb=13.0, fused_ce=True)
    act = activations(SHAPE, ParallelConfig(), mem, "megatron")
    # The fused path's own working set: 2 x 64 tokens x 32 vocab x 4 B + 64 tokens x h 64 x 2 B (bf16).
    working = (2 * 64 * 32 * 4 + 64 * 64 * 2) / 1e9
    assert act.total.value == 47.5 and act.fused_ce_saving.value == pytest.approx(13.0 - working)


def test_torch_activations_by_hand():
    """transformers' Llama in fp32 as the torch trainer runs it (rlslurm/plan/activations.py), worked by hand:
    s 128 x b 2 tokens, h 64, kv 64, f 256, vocab 32, 2 layers."""
    p = ParallelConfig(seq_len=128, micro_batch_size=2)
    act = activations(SHAPE, p, resolve(MemoryConfig(), "torch", "cpu"), "torch")
    assert act.layers.value == pytest.approx(2 * 256 * (9 * 64 + 2 * 64 + 4 * 256) * 4 / 1e9)
    assert act.around.value == pytest.approx(256 * (6 * 64 + 2 * 256) * 4 / 1e9)
    assert act.logits.value == pytest.approx(3 * 2 * 127 * 32 * 4 / 1e9)
    assert act.temporaries.value == 0.0  # the cpu profile: no communication buffers on a GPU
    full = activations(SHAPE, p, resolve(MemoryConfig(recompute="full"), "torch", "cpu"), "torch")
    assert full.layers.value == pytest.approx(2 * 256 * 64 * 4 / 1e9)  # each layer's input
    assert full.around.value == pytest.approx(act.around.value + act.layers.value / 2)  # + one layer recomputed


def test_torch_resident_and_peak_by_hand():
    """fp32 weights and grads, Adam's moments unsharded, DDP's buckets at world > 1; one micro-batch per step:
    the worse of the backward's start (no gradient yet) and its end (every gradient, and a tied embedding's two
    [vocab, h] gradients and their sum)."""
    counts = param_counts(SHAPE)
    mem = resolve(MemoryConfig(), "torch", "cpu")
    one = trainer_memory(counts, SHAPE, ParallelConfig(seq_len=128, micro_batch_size=2), mem, 4.0, dp=2,
                         backend="torch", accumulates=False)
    n = counts.dense
    assert (one.weights.value, one.grads.value, one.dense_optimizer.value, one.buckets.value) == pytest.approx(
        (n * 4 / 1e9, n * 4 / 1e9, n * 8 / 1e9, n * 4 / 1e9))
    head = 32 * 64 * 4 / 1e9
    assert one.peak.value == pytest.approx(max(one.resident.value - one.grads.value + one.activations.total.value,
                                               one.resident.value + 2 * head))
    more = trainer_memory(counts, SHAPE, ParallelConfig(seq_len=128, micro_batch_size=2), mem, 4.0, dp=2,
                          backend="torch", accumulates=True)
    assert more.peak.value == pytest.approx(more.resident.value + more.activations.total.value)


def test_resident_terms_by_hand():
    counts = param_counts(ModelConfig(experts=8, topk=2, expert_params_b=8.0, dense_params_b=1.0))
    p = ParallelConfig(ep=4, tp=1)
    mem = trainer_memory(counts, ModelConfig(experts=8, topk=2), p, _megatron(activation_gb=10.0), 80.0, dp=8)
    # experts per GPU 8e9 / 4 = 2e9; expert-DP 8 / 4 = 2; dense 1e9 sharded over DP 8
    assert mem.weights.value == pytest.approx((1 + 2) * 2)
    assert mem.grads.value == pytest.approx((1 + 2) * 4)
    assert mem.expert_optimizer.value == pytest.approx(2 * 12 / 2)
    assert mem.dense_optimizer.value == pytest.approx(1 * 12 / 8)
    assert mem.resident.value == pytest.approx(6 + 12 + 12 + 1.5)
    assert mem.peak.value == pytest.approx(31.5 + 10)
    assert mem.headroom_pct.value == pytest.approx(100 * (80 - 41.5) / 80)
    assert mem.expert_optimizer.explain() == "expert optimizer = 2e9 params x 12 B / expert-DP 2 = 12.00 GB"


@pytest.mark.parametrize("headroom,expected", [(10.8, "ok"), (8.0, "tight"), (3.5, "not advised"), (-0.1, "OOM")])
def test_verdict_thresholds(headroom: float, expected: str):
    assert verdict(headroom, MemoryConfig(tight_headroom_pct=10, not_advised_headroom_pct=5)) == expected


def test_divisibility_rules_name_their_numbers():
    assert world_rules(ParallelConfig(ep=16), 40)[0].message.startswith("parallel.ep = 16 does not divide DP = 40")
    assert "does not divide 10 training GPUs" in world_rules(ParallelConfig(tp=4), 10)[0].message
    broken = static_rules(ParallelConfig(cp=2, seq_len=102), layers=4, heads=4, kv_heads=4, experts=0,
                          gpus_per_node=8, rollout_tp=3)
    messages = " | ".join(r.message for r in broken)
    assert "2 x parallel.cp = 4 does not divide parallel.seq_len = 102" in messages
    assert "rollout.tp = 3 does not divide model.heads = 4" in messages
    assert "rollout.tp = 4 does not divide the 6 rollout GPUs" in rollout_rules(6, 4)[0].message
    assert static_rules(ParallelConfig(tp=2, seq_len=65), 2, 4, 4, 0, 8)[0].keys == ("parallel.tp", "parallel.seq_len")


def test_seq_len_rule_is_enforced_at_load():
    with pytest.raises(FieldError, match="sequence parallelism"):
        JobConfig(parallel=ParallelConfig(tp=2, seq_len=63))


def test_kv_cache_and_capacity_by_hand():
    m = ModelConfig(layers=40, hidden=2048, heads=16, kv_heads=4, head_dim=128)
    kv = kv_cache(m, RolloutConfig(tp=8, kv_bytes=2))
    assert kv.per_token.value * 1024 == 2 * 40 * 4 * 128 * 2
    assert kv.per_token_per_gpu.value * 1024 == 2 * 40 * 1 * 128 * 2  # TP 8 > 4 KV heads: replicated
    hw = HardwareConfig(profile="h20-96g", nodes=2, gpus_per_node=8)
    cap = capacity(Q("weights", 70.0, "GB"), kv, hw, RolloutConfig(tp=8, max_seq_len=4096), 16, 2.0)
    space = 96 * 0.9 - 70 / 8 - 2
    assert cap.kv_space_per_gpu.value == pytest.approx(space)
    assert cap.seqs_per_engine.value == math.floor(space * 1e9 / 20480 / 4096)
    assert cap.engines == 2 and cap.seqs_total.value == 2 * cap.seqs_per_engine.value


def test_weights_and_roofline():
    counts = param_counts(ModelConfig(dense_params_b=1.0, active_params_b=3.0))
    assert weights_gb(counts, None).value == pytest.approx(2.0)
    assert weights_gb(counts, 70.0).value == 70.0
    assert roofline(3e9, 4.0).value == pytest.approx(4000 / 6)


def test_sync_reward_step_and_amortisation():
    hw = HardwareConfig(profile="h20-96g", fs_bandwidth_gb_s=2, interconnect_gb_s=50)
    syncs = sync_times(Q("weights", 10.0, "GB"), hw)
    assert (syncs["disk"].value, syncs["broadcast"].value, syncs["ipc"].value) == (5.0, 0.2, 10 / 4000)
    rw = reward_phase(RLConfig(prompts_per_step=10, samples_per_prompt=4), RewardConfig(latency_s=3, concurrency=8),
                      TimingConfig())
    assert (rw.responses, rw.serial.value, rw.concurrent.value, rw.used.value) == (40, 120, 15, 15)
    assert reward_phase(RLConfig(), RewardConfig(), TimingConfig(reward_s=7)).used.value == 7
    assert train_step_s(TimingConfig(train_step_s=120, train_step_ref_gpus=40), 24, 40).value == 200
    assert train_step_s(TimingConfig(train_step_s=10), 2, 8).value == 40  # ref = all GPUs of the cluster
    broadcast, ipc = amortise(syncs, 1.0, 3600, 8)
    assert broadcast.saved_per_step.value == pytest.approx(4.8) and broadcast.saved_total_h.value == pytest.approx(4.8)
    assert ipc.saved_per_step.value == pytest.approx(5.0 - 10 / 4000 - 1.0)
    assert broadcast.saved_gpu_h.value == pytest.approx(4.8 * 8)


def test_checkpoint_interval_young_daly_and_cap():
    ck = checkpoint_interval(490, 24 * 3600, 120)
    assert ck.young_s == pytest.approx(math.sqrt(2 * 490 * 86400)) and ck.young_steps == 77
    ratio = 490 / (2 * 86400)
    assert ck.daly_s == pytest.approx(math.sqrt(2 * 490 * 86400) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - 490)
    assert checkpoint_interval(490, 86400, 120, wall_s=3510).young_s == 3510

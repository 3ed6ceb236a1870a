"""Megatron <-> HF conversion as pure functions: HF checkpoint -> Megatron shards -> HF is bitwise exact.

The HF side is a real checkpoint written by transformers' `save_pretrained` (Llama dense, Mixtral MoE),
read back with safetensors. That the shards have Megatron's real names and shapes is checked against a
real GPTModel in tests/integration/test_megatron_model.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from rlslurm.errors import ConfigError
from rlslurm.megatron.convert import (
    Layout,
    buckets,
    fuse_qkv,
    hf_config,
    hf_to_megatron,
    megatron_to_hf,
    rank_state_dict,
    split_qkv,
)
from rlslurm.modelspec import ModelConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# vocab 33: odd, so TP=2 pads the embedding; tied. The MoE one is untied, so both head paths are covered.
DENSE = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=33, tie_embeddings=True)
MOE = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=32, experts=4, topk=2,
                  expert_ffn_hidden=16, tie_embeddings=False)


def _hf_checkpoint(model: ModelConfig, path) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(model))
    hf.save_pretrained(path)
    return load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"dense": _hf_checkpoint(DENSE, tmp_path_factory.mktemp("dense")),
            "moe": _hf_checkpoint(MOE, tmp_path_factory.mktemp("moe"))}


CASES = [("dense", DENSE, Layout(tp=tp, pp=pp)) for tp in (1, 2) for pp in (1, 2)] + [
    ("moe", MOE, Layout(tp=tp, pp=pp, ep=ep)) for tp in (1, 2) for pp in (1, 2) for ep in (1, 2, 4)]


@pytest.mark.parametrize("kind,model,layout", CASES,
                         ids=[f"{k}-tp{lay.tp}-pp{lay.pp}-ep{lay.ep}" for k, _, lay in CASES])
def test_round_trip_is_bitwise(checkpoints, kind, model, layout):
    hf = checkpoints[kind]
    shards = hf_to_megatron(hf, model, layout)
    back = dict(megatron_to_hf(shards, model, layout))
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_shards_split_the_model_not_copy_it(checkpoints):
    layout = Layout(tp=2, pp=2, ep=2)
    shards = hf_to_megatron(checkpoints["moe"], MOE, layout)
    first = shards[(0, 1, 1)]
    # Stage 0 holds layer 0 only, numbered locally; the EP rank 1 holds experts 2 and 3 as local 0, 1.
    assert "decoder.layers.1.input_layernorm.weight" not in first
    assert sorted(n for n in first if "local_experts" in n) == [
        f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc{k}.weight" for j in (0, 1) for k in (1, 2)]
    w1 = checkpoints["moe"]["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    fc1 = first["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert torch.equal(fc1[: w1.shape[0] // 2], w1[w1.shape[0] // 2:])  # TP rank 1: second half of gate
    assert "output_layer.weight" in shards[(1, 0, 0)] and "embedding.word_embeddings.weight" not in shards[(1, 0, 0)]
    assert shards[(0, 0, 0)]["embedding.word_embeddings.weight"].shape == (MOE.vocab // 2, MOE.hidden)


def test_tied_head_on_last_stage_is_the_padded_embedding(checkpoints):
    layout = Layout(tp=2, pp=2)
    last = rank_state_dict(checkpoints["dense"], DENSE, layout, (1, 1, 0))
    head = last["output_layer.weight"]  # rows 17..33 of the padded 34-row vocab; the last row is padding
    assert head.shape == (17, DENSE.hidden)
    assert torch.equal(head[:-1], checkpoints["dense"]["model.embed_tokens.weight"][17:])
    assert not head[-1].any()


def test_qkv_groups_each_kv_head_with_its_queries():
    heads, kv_heads, head_dim, hidden = 4, 2, 3, 5
    # Row r of q/k/v holds the value 1000*which + r, so the fused order can be read off.
    q = (torch.arange(heads * head_dim) + 1000.0)[:, None].expand(-1, hidden)
    k = (torch.arange(kv_heads * head_dim) + 2000.0)[:, None].expand(-1, hidden)
    v = (torch.arange(kv_heads * head_dim) + 3000.0)[:, None].expand(-1, hidden)
    fused = fuse_qkv(q, k, v, heads, kv_heads)
    expected = [1000, 1001, 1002, 1003, 1004, 1005, 2000, 2001, 2002, 3000, 3001, 3002,
                1006, 1007, 1008, 1009, 1010, 1011, 2003, 2004, 2005, 3003, 3004, 3005]
    assert fused[:, 0].tolist() == expected
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, kv_heads), (q, k, v)))


def test_buckets_respect_the_byte_limit_and_keep_order():
    pairs = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 100, 1, 2])]
    got = list(buckets(pairs, bucket_bytes=160))  # float32: 40, 40, 120, 20, 400, 4, 8 bytes
    assert [[n for n, _ in b] for b in got] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5", "t6"]]


def test_missing_tensor_and_bad_layout_are_config_errors(checkpoints):
    hf = dict(checkpoints["dense"])
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConfigError, match="up_proj"):
        hf_to_megatron(hf, DENSE, Layout())
    with pytest.raises(ConfigError, match="parallel.tp = 4 must divide model.kv_heads = 2"):
        hf_to_megatron(checkpoints["dense"], DENSE, Layout(tp=4))
    with pytest.raises(ConfigError, match="parallel.ep = 3"):
        hf_to_megatron(checkpoints["moe"], MOE, Layout(ep=3))

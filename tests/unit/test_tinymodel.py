"""The embedded model: built from `model:`, deterministic from the seed, saved in HF layout, reloaded bit-equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlslurm.errors import ConfigError
from rlslurm.evaluate import greedy_accuracy, greedy_responses
from rlslurm.modelspec import ModelConfig
from rlslurm.tasks.arithmetic import Problem, score
from rlslurm.tinymodel import HF_FILES, build_model, llama_config, load_hf, save_hf

SMALL = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=28, max_positions=32)


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_config_follows_model_section():
    c = llama_config(SMALL)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size, c.max_position_embeddings, c.tie_word_embeddings) == \
        (2, 32, 4, 2, 64, 28, 32, True)


def test_head_dim_is_the_model_sections_not_hidden_over_heads():
    # vLLM's CPU attention serves head sizes >= 32: model.head_dim gives the embedded model one at hidden 64.
    wide = ModelConfig(layers=1, hidden=64, heads=4, head_dim=32, ffn_hidden=64, vocab=28, max_positions=32)
    assert llama_config(wide).head_dim == 32 and llama_config(SMALL).head_dim == 8
    attn = build_model(wide, seed=0).model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (4 * 32, 64) and tuple(attn.o_proj.weight.shape) == (64, 4 * 32)


def test_same_seed_same_weights_other_seed_other_weights():
    assert _equal(build_model(SMALL, seed=3), build_model(SMALL, seed=3))
    assert not _equal(build_model(SMALL, seed=3), build_model(SMALL, seed=4))


def test_build_leaves_the_callers_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model(SMALL, seed=99)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("model,fragment", [
    (ModelConfig(vocab=8), "model.vocab = 8 must be >= 26"),
    (ModelConfig(experts=4, topk=1), "model.experts = 4"),
])
def test_shapes_the_embedded_model_cannot_take_are_refused(model, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_model(model, seed=0)


def test_save_reload_is_bit_equal_and_atomic(tmp_path: Path):
    model = build_model(SMALL, seed=1)
    out = save_hf(model, tmp_path / "export" / "hf", max_new_tokens=5)
    assert sorted(p.name for p in out.iterdir()) == sorted(HF_FILES)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 5
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert _equal(model, reloaded)
    tensors = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())

    # A second export replaces the first whole, and leaves no temp or old directory beside it.
    other = build_model(SMALL, seed=2)
    save_hf(other, out)
    assert _equal(other, load_hf(out)[0])
    assert [p.name for p in out.parent.iterdir()] == ["hf"]


def test_load_names_the_missing_files(tmp_path: Path):
    save_hf(build_model(SMALL, seed=1), tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="missing model.safetensors"):
        load_hf(tmp_path / "hf")


def test_greedy_eval_of_the_reloaded_model_matches_the_original(tmp_path: Path):
    model = build_model(SMALL, seed=5)
    out = save_hf(model, tmp_path / "hf")
    reloaded, tokenizer = load_hf(out)
    problems = [Problem(a, "+", b) for a in (1, 23, 45) for b in (6, 78)]
    first = greedy_responses(model, tokenizer, [p.prompt for p in problems], max_new_tokens=4, batch_size=2)
    again = greedy_responses(reloaded, tokenizer, [p.prompt for p in problems], max_new_tokens=4)
    assert first == again and len(first) == len(problems)
    result = greedy_accuracy(reloaded, tokenizer, problems, max_new_tokens=4)
    assert result.total == len(problems) and result.correct == sum(int(score(p, r)) for p, r in zip(problems, again))

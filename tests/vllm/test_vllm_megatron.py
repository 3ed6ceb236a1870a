"""A Megatron-core GPTModel (CPU, gloo, world 1) converted to HF and served by vLLM: same greedy tokens,
for a dense model with a tied embedding and for an MoE one (Mixtral layout).

The trainer's side runs here (main venv, megatron-core): build the model, generate greedily with its
own forward, stream it out with convert.export_hf and write the HF directory (plus the fixtures'
character tokenizer). vLLM's own server (rollout.engine: vllm) then loads that directory and must produce
the same tokens, with logprobs that match Megatron's logits. The dense model also takes a weight sync: its
embedding is tied, so vLLM serves that matrix twice (lookup table and a separately packed LM-head
GEMM), and VERIFY must see both copies updated.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlslurm.modelspec import ModelConfig
from rlslurm.rollout.engine import HFEngine, SamplingParams
from rlslurm.sync.broadcast import free_port
from rlslurm.sync.checksum import checksums, compare
from rlslurm.sync.config import SyncConfig
from rlslurm.sync.disk import DiskTransport
from rlslurm.sync.protocol import WeightSync
from rollout_fixtures import save_tokenizer
from vllm_fixtures import start_vllm_serve

# Head size 64 / 2 = 32, the smallest vLLM's CPU attention takes; one KV head (GQA).
DENSE = ModelConfig(layers=2, hidden=64, heads=2, kv_heads=1, ffn_hidden=128, vocab=48, tie_embeddings=True)
MOE = ModelConfig(layers=2, hidden=64, heads=2, kv_heads=1, ffn_hidden=128, vocab=48, experts=4, topk=2,
                  expert_ffn_hidden=32, tie_embeddings=False)
NEW_TOKENS = 8
EOS_ID = 2  # LlamaConfig's default, and the fixtures' tokenizer's </s>


def _megatron_worker(rank: int, port: int, out_dir: str, model: ModelConfig):
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.convert import Layout, export_hf, hf_config
    from rlslurm.megatron.model import build_gpt_model, forward_logits, greedy_generate, init_parallel

    init_process_group(Topology(rank, 1, rank, "127.0.0.1", port), timeout_s=60)
    init_parallel(Layout(), seed=0)
    gpt = build_gpt_model(model, Layout())
    tensors = {name: t.detach().cpu().contiguous() for name, t in export_hf(gpt, model, Layout())}
    # Prompts from the tokenizer's ordinary characters (ids 4..45): vLLM refuses ids past its vocabulary.
    prompt = torch.randint(4, 46, (4, 5), generator=torch.Generator().manual_seed(7))
    tokens = greedy_generate(gpt, prompt, NEW_TOKENS, model.vocab)
    with torch.no_grad():
        logprobs = torch.log_softmax(forward_logits(gpt, tokens, model.vocab).float(), dim=-1)
    chosen = logprobs[:, 4:-1].gather(-1, tokens[:, 5:, None])[..., 0]
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_config(model).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "megatron.json"), "w") as f:
        json.dump({"prompts": prompt.tolist(), "tokens": tokens[:, 5:].tolist(), "logprobs": chosen.tolist()}, f)


@pytest.mark.parametrize("name", ["dense-tied", "moe"])
def test_vllm_serves_a_converted_megatron_checkpoint_token_for_token(name, vllm_python, tmp_path):
    model = {"dense-tied": DENSE, "moe": MOE}[name]
    megatron_dir = tmp_path / "hf"
    megatron_dir.mkdir()
    mp.spawn(_megatron_worker, args=(free_port(), str(megatron_dir), model), nprocs=1, join=True)
    save_tokenizer(megatron_dir)
    want = json.loads((megatron_dir / "megatron.json").read_text())
    assert len({t for row in want["tokens"] for t in row}) > 2, want  # not a trivially constant model
    engine = start_vllm_serve(megatron_dir, tmp_path, vllm_python)
    try:
        out = engine.client.completions(want["prompts"], max_tokens=NEW_TOKENS, temperature=0)
        if not model.experts:  # the vLLM engine's weight access does not cover MoE experts (packed on CPU)
            before = [c["token_ids"] for c in out["choices"]]
            _update_the_tied_model_and_verify(engine, megatron_dir, want["prompts"], before, tmp_path)
    finally:
        engine.stop(timeout_s=30)
    gap = 0.0
    for choice, tokens, logprobs in zip(out["choices"], want["tokens"], want["logprobs"]):
        got = choice["token_ids"]
        # vLLM stops at </s>; Megatron's greedy loop runs on: compare up to and including it.
        assert got == tokens[: len(got)], (got, tokens)
        assert len(got) == NEW_TOKENS or got[-1] == EOS_ID
        gap = max([gap] + [abs(a - b) for a, b in zip(choice["token_logprobs"], logprobs)])
    print(f"FIGURE vllm_vs_megatron_greedy[{name}]: {len(want['prompts'])}/{len(want['prompts'])} prompts equal, "
          f"max |dlogprob| {gap:.2e}")
    assert gap < 1e-4


def _update_the_tied_model_and_verify(engine, megatron_dir, prompts, before, tmp_path):
    """The served checksums equal the checkpoint's; an update of the tied embedding (which vLLM's CPU
    backend serves twice: the lookup table and a packed LM-head GEMM) passes VERIFY and is served."""
    tensors = load_file(str(megatron_dir / "model.safetensors"))
    served = engine.client.checksums()
    assert sorted(served) == sorted(tensors) and not compare(checksums(tensors.items()), served)

    g = torch.Generator().manual_seed(1)
    new = {name: t + 0.2 * torch.randn(t.shape, generator=g) for name, t in sorted(tensors.items())}
    new_dir = tmp_path / "scaled"
    new_dir.mkdir()
    save_file(new, str(new_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (new_dir / name).write_bytes((megatron_dir / name).read_bytes())
    hf = HFEngine(new_dir).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))

    transport = DiskTransport(tmp_path / "weights")
    report = WeightSync([engine.client], transport, SyncConfig(timeout_s=60, retries=0)).sync(new, version=1)
    assert report.attempts == 1
    out = engine.client.completions(prompts, max_tokens=NEW_TOKENS, temperature=0)
    assert out["policy_version"] == 1
    assert [c["token_ids"] for c in out["choices"]] == [h.token_ids for [h] in hf] != before

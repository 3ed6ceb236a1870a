"""A real Megatron-core GPTModel on CPU over gloo, exported to HF and checked against transformers; its
trainer fitting a batch; its kernel fusions chosen from what imports.

Each test spawns real processes (world 1, world 2) that build the model with rlslurm.megatron.model,
stream it out with convert.export_hf (the collective TP/EP/PP gather), write a safetensors checkpoint,
load it with transformers' from_pretrained and compare greedy tokens and logits (fp32). The inverse
(an HF checkpoint cut into this rank's shard) is loaded into the live model with strict names and shapes.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

from rlslurm.modelspec import ModelConfig

DENSE = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=48, tie_embeddings=True)
MOE = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=48, experts=4, topk=2,
                  expert_ffn_hidden=32, tie_embeddings=False)
NEW_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_hf(pairs, model: ModelConfig, path: str) -> None:
    from safetensors.torch import save_file

    from rlslurm.megatron.convert import hf_config

    tensors = {name: t.detach().cpu().contiguous() for name, t in pairs}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf_config(model).save_pretrained(path)


def _check_against_transformers(gpt, model: ModelConfig, layout, path: str, rank: int) -> None:
    """Export, save on rank 0, reload in transformers, compare greedy tokens and logits."""
    import transformers

    from rlslurm.megatron.convert import export_hf
    from rlslurm.megatron.model import forward_logits, greedy_generate

    tensors = {}
    for name, t in export_hf(gpt, model, layout):  # every rank must drain the collective stream
        tensors[name] = t
    prompt = torch.randint(0, model.vocab, (2, 5), generator=torch.Generator().manual_seed(7))
    tokens = greedy_generate(gpt, prompt, NEW_TOKENS, model.vocab)
    with torch.no_grad():
        logits = forward_logits(gpt, tokens, model.vocab)
    if rank == 0:
        _save_hf(tensors.items(), model, path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_tokens = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                attention_mask=torch.ones_like(prompt), pad_token_id=None, eos_token_id=None)
        with torch.no_grad():
            hf_logits = hf(tokens).logits
        diff = (hf_logits - logits).abs().max().item()
        assert torch.equal(hf_tokens, tokens), f"{path}: HF {hf_tokens.tolist()} != Megatron {tokens.tolist()}"
        assert diff < 1e-5, f"{path}: max |logit diff| {diff}"
        # The greedy run must not be trivially constant (a broken model can agree with a broken model).
        assert len(set(tokens[:, 5:].flatten().tolist())) > 1, tokens.tolist()
        with open(os.path.join(path, "figures.json"), "w") as f:
            json.dump({"max_abs_logit_diff": diff}, f)


def _load_shard_and_compare(model: ModelConfig, layout, hf_tensors, seed: int):
    """Cut this rank's shard from HF tensors into a freshly (differently) initialised model; export again."""
    from rlslurm.megatron.convert import export_hf, load_hf_into
    from rlslurm.megatron.model import build_gpt_model, init_parallel

    init_parallel(layout, seed=seed)
    gpt = build_gpt_model(model, layout)
    load_hf_into(gpt, hf_tensors, model, layout)
    back = dict(export_hf(gpt, model, layout))
    assert sorted(back) == sorted(hf_tensors)
    differ = [n for n in back if not torch.equal(back[n], hf_tensors[n])]
    assert not differ, differ


def _worker(rank: int, world: int, port: int, out_dir: str, cases: list):
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.convert import Layout, SafetensorsDir, export_hf
    from rlslurm.megatron.model import build_gpt_model, init_parallel

    init_process_group(Topology(rank, world, rank, "127.0.0.1", port), timeout_s=60)
    for name, model, (tp, pp, ep) in cases:
        layout = Layout(tp=tp, pp=pp, ep=ep)
        path = os.path.join(out_dir, name)
        if pp == 1:
            init_parallel(layout, seed=0)
            gpt = build_gpt_model(model, layout)
            _check_against_transformers(gpt, model, layout, path, rank)
            dist.barrier()  # rank 0 wrote the checkpoint; every rank loads its own cut from disk
            tensors = SafetensorsDir(path)
        else:
            # Megatron's pipeline schedules are CUDA-only: at PP > 1 check the layout, not the forward.
            init_parallel(Layout(tp=1), seed=0)
            tensors = dict(export_hf(build_gpt_model(model, Layout()), model, Layout()))
        _load_shard_and_compare(model, layout, tensors, seed=1)


def _spawn(world: int, tmp_path, cases):
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path), cases), nprocs=world, join=True)


def test_world_1_dense_and_moe_match_transformers(tmp_path):
    _spawn(1, tmp_path, [("dense", DENSE, (1, 1, 1)), ("moe", MOE, (1, 1, 1))])
    for name in ("dense", "moe"):
        assert (tmp_path / name / "model.safetensors").exists()


def test_world_2_tp_ep_pp_match_transformers(tmp_path):
    _spawn(2, tmp_path, [("dense-tp2", DENSE, (2, 1, 1)), ("moe-tp2", MOE, (2, 1, 1)),
                         ("moe-ep2", MOE, (1, 1, 2)), ("dense-pp2", DENSE, (1, 2, 1))])
    figures = {p.name: json.loads((p / "figures.json").read_text()) for p in tmp_path.iterdir()
               if (p / "figures.json").exists()}
    assert sorted(figures) == ["dense-tp2", "moe-ep2", "moe-tp2"]


def test_recompute_modes_make_valid_megatron_configs():
    from rlslurm.megatron.convert import Layout
    from rlslurm.megatron.model import transformer_config
    from rlslurm.megatron.trainer import MegatronTrainConfig, _recompute_kwargs

    full = transformer_config(DENSE, Layout(), **_recompute_kwargs(MegatronTrainConfig(recompute="full")))
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    selective = transformer_config(DENSE, Layout(), **_recompute_kwargs(MegatronTrainConfig()))
    assert selective.recompute_granularity == "selective" and "core_attn" in selective.recompute_modules
    assert transformer_config(DENSE, Layout()).recompute_granularity is None


def _train_worker(rank: int, port: int, out_dir: str):
    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.convert import Layout
    from rlslurm.megatron.model import init_parallel
    from rlslurm.megatron.trainer import MegatronTrainConfig, build_trainer, train_step

    torch.set_num_threads(1)
    init_process_group(Topology(0, 1, 0, "127.0.0.1", port), timeout_s=60)
    init_parallel(Layout(), seed=0)
    ddp, optimizer = build_trainer(MOE, Layout(), MegatronTrainConfig(recompute="full"), lr=1e-2, grad_clip=1.0)
    tokens = torch.randint(0, MOE.vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    # Two micro-batches of the same rows, each token weighing 1 / 64: the loss is their mean NLL.
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "weights": torch.full((2, 16), 1 / 64)}
    losses = [train_step(ddp, optimizer, [batch, batch])["loss"] for _ in range(8)]
    assert 3.0 < losses[0] < 5.0, losses  # ~ln(48): the mean, not a sum
    assert losses[-1] < 0.8 * losses[0], losses


def test_megatron_trainer_fits_one_batch(tmp_path):
    """MoE (allgather dispatcher on CPU), full recompute (its RNG fork on CPU), bf16 weights with fp32
    master copies in the distributed optimizer: eight steps of Megatron's schedule fit one batch."""
    mp.spawn(_train_worker, args=(_free_port(), str(tmp_path)), nprocs=1, join=True)


# -- kernel fusions: chosen from what imports (rlslurm/megatron/fusions.py) -------------------------------

SOFTMAX_KERNELS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")


def test_fusions_are_on_only_where_their_kernels_import_and_each_disabled_one_says_why(monkeypatch, caplog):
    import types

    from rlslurm.megatron.fusions import choose_fusions, flags

    for name in SOFTMAX_KERNELS:  # the wheel's case, forced: importing any of them fails
        monkeypatch.setitem(sys.modules, name, None)
    with caplog.at_level("INFO", logger="rlslurm.megatron.fusions"):
        on_gpu = {f.flag: f for f in choose_fusions(on_gpu=True)}
    assert not on_gpu["masked_softmax_fusion"].on
    assert "scaled_masked_softmax_cuda does not import" in on_gpu["masked_softmax_fusion"].reason
    for fusion in on_gpu.values():  # every flag rlslurm sets, each off one logged with its reason
        if not fusion.on:
            assert f"megatron fusion {fusion.flag} off: {fusion.reason}" in caplog.text
    # On a GPU a missing kernel is a WARNING: the only level a trainer rank's stderr shows
    assert [r.levelname for r in caplog.records if "masked_softmax_fusion off" in r.getMessage()] == ["WARNING"]
    assert {"masked_softmax_fusion", "gradient_accumulation_fusion", "apply_rope_fusion",
            "bias_activation_fusion"} <= set(on_gpu)
    # Where the kernels import (Megatron-LM's fused_kernels built on a GPU box), the fusion is on.
    for name in SOFTMAX_KERNELS:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert flags(choose_fusions(on_gpu=True))["masked_softmax_fusion"] is True
    assert not any(flags(choose_fusions(on_gpu=False)).values())  # no GPU: no CUDA kernel


def _fusion_worker(rank: int, port: int, out: str):
    """A bf16 GPTModel built with the fusions a GPU process chooses where the softmax kernels do not import,
    and one built as before (masked_softmax_fusion on with a GPU): a 20-token forward through each."""
    for name in SOFTMAX_KERNELS:
        sys.modules[name] = None  # forced missing, as in the megatron-core wheel
    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.convert import Layout
    from rlslurm.megatron.fusions import choose_fusions, flags
    from rlslurm.megatron.model import build_gpt_model, forward_logits, init_parallel

    torch.set_num_threads(1)
    init_process_group(Topology(0, 1, 0, "127.0.0.1", port), timeout_s=60)
    init_parallel(Layout(), seed=0)
    # 20 keys (16 < keys <= 4096, divisible by 4) x batch 2 x 4 heads: the shapes that take the fused path.
    tokens = torch.randint(0, DENSE.vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    found = {}
    cases = (("chosen", flags(choose_fusions(on_gpu=True))), ("before", {"masked_softmax_fusion": True}))
    for case, overrides in cases:
        gpt = build_gpt_model(DENSE, Layout(), torch.bfloat16, **overrides)
        try:
            with torch.no_grad():
                found[case] = f"ok {tuple(forward_logits(gpt, tokens, DENSE.vocab).shape)}"
        except ImportError as e:
            found[case] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        json.dump(found, f)


def test_a_bf16_forward_of_real_prompt_length_runs_without_the_softmax_kernel(tmp_path):
    """The defect: masked_softmax_fusion on for any GPU, and in bf16 Megatron's availability check imports
    scaled_masked_softmax_cuda, which the megatron-core wheel does not ship. Built as before, the forward
    dies on that import (on CPU too: the check never looks at the device); built with the chosen fusions,
    it runs."""
    mp.spawn(_fusion_worker, args=(_free_port(), str(tmp_path / "found.json")), nprocs=1, join=True)
    found = json.loads((tmp_path / "found.json").read_text())
    assert found["chosen"] == "ok (2, 20, 48)", found
    assert "scaled_masked_softmax_cuda" in found["before"] and "Error" in found["before"], found

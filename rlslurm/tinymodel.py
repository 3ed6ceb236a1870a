"""The embedded default model: a small Llama-architecture causal LM built offline from `model:`.

    model = build_model(job.model, seed=job.train.seed)       # random init, same on every rank
    save_hf(model, out_dir)                                    # config.json, model.safetensors, ...
    model, tokenizer = load_hf(out_dir)                        # what an RL job's train.init_from reads

Llama layout because both consumers speak it: vLLM loads the exported directory as is, and the
Megatron conversion maps its state-dict names onto Llama's. `save_hf` writes into a temp directory and
renames it into place, so a reader (an engine, a resumed job) never sees half a model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from rlslurm import lora
from rlslurm.durable import fsync
from rlslurm.errors import ConfigError
from rlslurm.modelspec import ModelConfig
from rlslurm.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB, is_embedded, save_model_tokenizer, save_tokenizer

# Files that make an exported directory complete; readers check for these.
HF_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json")


def llama_config(model: ModelConfig) -> LlamaConfig:
    """The transformers config for `model:`; refuses shapes the embedded model cannot take."""
    if model.is_moe:
        raise ConfigError(f"model.experts = {model.experts}: the embedded CPU model is dense; "
                          "set model.experts = 0 (MoE models run through train.backend = megatron)")
    if model.vocab < len(VOCAB):
        raise ConfigError(f"model.vocab = {model.vocab} must be >= {len(VOCAB)}, "
                          "the size of the embedded tokenizer's vocabulary")
    return LlamaConfig(
        vocab_size=model.vocab,
        hidden_size=model.hidden,
        intermediate_size=model.ffn_hidden,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.n_kv_heads,
        # model.head_dim may differ from hidden / heads (vLLM's CPU attention needs a head size >= 32).
        head_dim=model.dim_per_head,
        max_position_embeddings=model.max_positions,
        tie_word_embeddings=model.tie_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def generation_config(max_new_tokens: int = 8) -> GenerationConfig:
    """Greedy by default, stopping at </s>: what an engine uses unless a request says otherwise."""
    return GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                            do_sample=False, max_new_tokens=max_new_tokens)


def build_model(model: ModelConfig, seed: int) -> LlamaForCausalLM:
    """A randomly initialised model; the same seed gives bit-equal weights in every process."""
    config = llama_config(model)
    # fork_rng keeps the caller's global RNG stream (data order, dropout) independent of model init.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = LlamaForCausalLM(config)
    net.generation_config = generation_config()
    return net


def save_hf(model: torch.nn.Module, directory: str | Path, max_new_tokens: int = 8, tokenizer=None) -> Path:
    """Write `model` + tokenizer in HF layout at `directory`, atomically (temp dir, then rename). A model with
    LoRA layers (train.lora) is written merged, a plain HF model, with its adapter in `directory`/adapter.

    `tokenizer`: None or the embedded one = the embedded tokenizer, built here; a real model's own
    (rlslurm/models/) is written as it is, with a greedy generation config from its special token ids.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "module", model)  # unwrap DistributedDataParallel
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    adapted = None
    if lora.has_lora(model):  # train.lora: the merged plain model, its adapter beside it (rlslurm/lora.py)
        adapted, model = model, lora.merged_model(model)
    try:
        if adapted is not None:
            lora.save_adapter(adapted, tmp / "adapter")
        if tokenizer is None or is_embedded(tokenizer):
            model.generation_config = generation_config(max_new_tokens)
            model.save_pretrained(str(tmp), safe_serialization=True)
            save_tokenizer(tmp, max_length=model.config.max_position_embeddings)
        else:
            eos = tokenizer.eos_token_id
            model.generation_config = GenerationConfig(
                bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
                do_sample=False, max_new_tokens=max_new_tokens)
            model.save_pretrained(str(tmp), safe_serialization=True)
            save_model_tokenizer(tokenizer, tmp, max_length=model.config.max_position_embeddings)
        for name in HF_FILES:
            fsync(tmp / name)
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_hf(directory: str | Path) -> tuple[LlamaForCausalLM, object]:
    """(model in eval mode, tokenizer) from an exported directory; names the missing file if incomplete."""
    directory = Path(directory)
    missing = [name for name in HF_FILES if not (directory / name).is_file()]
    if missing:
        raise ConfigError(f"{directory}: not a complete HF model directory (missing {', '.join(missing)}); "
                          "point train.init_from at an SFT run's export/hf")
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(directory))


def _replace_dir(new: Path, target: Path) -> None:
    # rename(2) cannot replace a non-empty directory, so an old export moves aside first; between the
    # two renames a reader finds no directory (and waits or fails), never a mix of two models.
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    os.rename(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

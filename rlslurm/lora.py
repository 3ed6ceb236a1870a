"""LoRA adapters (`train.lora`) on the torch trainer and the transformers engine, through PEFT.

    model = inject(load_hf(dir)[0], job.train.lora)   # the HF model with LoRA layers in it, base weights frozen
    adapters(model)                                    # {name: tensor}: only lora_A / lora_B, what trains and syncs
    merged_state(model)                                # {HF name: W + (alpha / rank) B A}: a plain HF model's tensors
    save_hf(model, dir)                                # rlslurm/tinymodel.py: the merged model, plus dir/adapter/

PEFT's `get_peft_model` puts a LoRA layer around each target linear layer *inside* the Hugging Face model; this
project keeps that model (`get_base_model()`), not PEFT's wrapper, so every other part sees the model it knows
(the scorer, DDP, the memory meter) and names stay Hugging Face's with PEFT's `.base_layer` / `.lora_A.default`
inserted. The transformers engine injects the same layers at start (`--lora`), so trainer and engine hold the
same named tensors: a weight sync sends the adapters alone and VERIFY checksums the adapters the engine serves
(the first sync of each start and a replacement engine's send everything once, so the base the engine loaded
is verified too). vLLM's engine is sent the merged weights instead (its own LoRA loading needs adapters on
disk and a model name per request: not wired yet), so its sync bytes stay those of the full model.

Only the adapters train, are checkpointed and resumed (the optimizer holds their moments alone; the frozen
base is train.init_from, read again at every start). An export is the merged plain HF model, loadable
anywhere without PEFT (vLLM, transformers, the next job's train.init_from), with the adapter beside it in
`adapter/` (PEFT's own adapter_config.json + adapter_model.safetensors). Megatron-core 0.16 has no LoRA
module of its own: train.backend megatron refuses train.lora (rlslurm/megatron/policy.py's job_rules).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rlslurm.configfile import check, check_range

LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama block (attention and MLP): LoRA's targets by default."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int = 0
    """LoRA's rank r (Hu et al. 2021, arXiv:2106.09685): each target weight W trains as W + (alpha / r) B A, B of
    [out, r] (zeros at first) and A of [r, in]; only A and B train. 0 = full fine-tuning. Range [0, 4096]."""
    alpha: float = 16.0
    """LoRA's alpha: the update is scaled by alpha / rank. Range (0, 1000000]."""
    dropout: float = 0.0
    """Dropout on a LoRA layer's input, in training mode only (SFT; the RL policy scores in eval mode, so its
    fresh samples' ratio is exactly 1). Range [0, 1)."""
    targets: tuple[str, ...] = LLAMA_LINEAR
    """Module names (the last part of the name, PEFT's target_modules) that get a LoRA layer; default every
    linear layer of a Llama block."""

    def __post_init__(self):
        check_range(self.rank, "rank", 0, 4096)
        check_range(self.alpha, "alpha", 0, 1e6, low_open=True)
        check(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        check(bool(self.targets) and all(isinstance(t, str) and t.strip() for t in self.targets), "targets",
              "must name at least one module (e.g. q_proj, v_proj)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def to_flag(self) -> str:
        """The engine server's --lora value (JSON)."""
        return json.dumps({**asdict(self), "targets": list(self.targets)})

    @classmethod
    def from_flag(cls, text: str) -> "LoraConfig":
        data = json.loads(text)
        return cls(**{**data, "targets": tuple(data["targets"])})


def inject(model, cfg: LoraConfig, seed: int = 0):
    """`model` (a transformers causal LM) with LoRA layers on cfg.targets, every other weight frozen; the same
    model object's class, PEFT's wrapper left behind. A is initialised from `seed` (train.seed) alone, the
    process's RNG left as it was, so a run and its resumed or repeated twin start from the same adapters."""
    import torch
    from peft import LoraConfig as PeftLora, get_peft_model

    peft_cfg = PeftLora(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.targets),
                        bias="none", task_type="CAUSAL_LM")
    try:
        wrapped = get_peft_model(model, peft_cfg)
    except ValueError as e:  # no module matched: name what the model has
        from rlslurm.errors import ConfigError

        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise ConfigError(f"train.lora.targets = {list(cfg.targets)}: {e}; the model's linear layers are "
                          f"{names}") from None
    model = wrapped.get_base_model()
    # PEFT draws A from the process's RNG on the layer's device: drawn again here from `seed` on the CPU, the
    # same distribution (kaiming_uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), whatever the device.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            a = layer.lora_A["default"].weight
            bound = 1.0 / a.shape[1] ** 0.5
            a.copy_(torch.empty(a.shape).uniform_(-bound, bound, generator=generator))
    return model


def has_lora(model) -> bool:
    """Whether `model` holds LoRA layers (`inject`); a model view without parameters of its own (the Megatron
    policy's HFView, which save_hf exports too) holds none."""
    named = getattr(model, "named_parameters", None)
    return named is not None and any(is_adapter(name) for name, _ in named())


def is_adapter(name: str) -> bool:
    """A LoRA tensor's name (PEFT's `lora_A` / `lora_B`)."""
    return ".lora_A." in name or ".lora_B." in name


def adapters(model) -> dict:
    """{name: tensor} of the LoRA tensors alone (what trains, is checkpointed and synced to an engine)."""
    return {n: t.detach() for n, t in model.state_dict().items() if is_adapter(n)}


def lora_layers(model):
    """(HF name of the wrapped linear layer, the LoRA layer) for every LoRA layer of `model`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def merged_state(model) -> dict:
    """The tensors of the plain HF model `model` stands for, under Hugging Face names: each LoRA layer's weight
    W + (alpha / rank) B A (PEFT's own get_delta_weight), every other tensor as it is; no adapter names."""
    import torch

    deltas = {f"{name}.base_layer.weight": (f"{name}.weight", layer.get_delta_weight("default"))
              for name, layer in lora_layers(model)}
    out = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if is_adapter(name):
                continue
            if name in deltas:
                plain, delta = deltas[name]
                out[plain] = (tensor + delta.to(tensor.dtype)).detach()
            else:
                out[name.replace(".base_layer.", ".")] = tensor.detach()
    return out


def merged_model(model):
    """A plain transformers model (no PEFT layer) with `merged_state(model)`'s weights, on the CPU."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype)
    missing, unexpected = plain.load_state_dict({n: t.cpu() for n, t in merged_state(model).items()}, strict=False)
    # a tied LM head is one tensor saved once: it is the only name a tied model may lack
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"LoRA merge: names the plain model lacks {unexpected[:4]}, or lacks {missing[:4]}")
    plain.generation_config = model.generation_config
    return plain.eval()


def save_adapter(model, directory: str | Path) -> None:
    """PEFT's adapter files of `model` in `directory`: adapter_config.json and adapter_model.safetensors, which
    `peft.PeftModel.from_pretrained(base, directory)` loads onto the base model."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].save_pretrained(str(directory))  # `inject` leaves PEFT's config on the model
    tensors = {_peft_name(n): t.detach().cpu().contiguous() for n, t in adapters(model).items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def _peft_name(name: str) -> str:
    """A LoRA tensor's name as PEFT saves it: the wrapper's prefix, no adapter name."""
    return "base_model.model." + name.replace(".default.", ".")

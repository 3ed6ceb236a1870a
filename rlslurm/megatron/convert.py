"""Megatron-core shards <-> Hugging Face checkpoint tensors, one parameter at a time.

The HF side is the *checkpoint* layout (what `save_pretrained` writes and vLLM loads): `LlamaForCausalLM`
for a dense model, `MixtralForCausalLM` for an MoE one (Llama plus per-expert `w1`/`w3`/`w2` and a
`gate` router: no shared experts, no QK-norm, so every Megatron tensor maps to HF by slicing alone).

What differs between the two sides, and where it is handled:
  - fused QKV: Megatron stores one `linear_qkv` with the rows grouped per KV head
    `[q_0..q_{H/G-1}, k, v]` x G groups, and TP splits whole groups -> `fuse_qkv` / `split_qkv`;
  - fused gate/up: each TP shard of `linear_fc1` is `[gate_t; up_t]` (not `[gate; up]` of the full
    matrix) -> `_merge` / `_split` for kind "gated";
  - experts: Megatron numbers them locally per EP rank (`local_experts.j`), HF globally;
  - PP: every stage numbers its layers from 0; embedding on the first stage, final norm and LM head on
    the last; a tied LM head on a PP>1 last stage is a copy of the embedding and is not exported;
  - vocab: Megatron's embedding/LM head are padded to a multiple of TP; the padding rows are dropped.

`hf_to_megatron` / `megatron_to_hf` are pure functions of full dicts (tests, offline conversion,
loading an SFT checkpoint into a sharded trainer). `export_hf` is the live, collective path: each
parameter is gathered over TP/EP and broadcast over PP only when its turn comes, so the full model never
sits in one process; `buckets` groups the stream for weight sync.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from rlslurm.errors import CheckpointError, ConfigError
from rlslurm.modelspec import ModelConfig

NORM_EPS = 1e-5
"""RMSNorm epsilon, the same on both sides of the conversion."""
ROPE_BASE = 10000.0
"""RoPE theta, the same on both sides of the conversion."""

Shards = dict[tuple[int, int, int], dict[str, torch.Tensor]]
"""Megatron state dicts keyed by (pp stage, tp rank, ep rank); non-expert tensors repeat across ep."""


@dataclass(frozen=True)
class Layout:
    """How the Megatron model is split: tensor, pipeline and expert parallel sizes."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def check(self, model: ModelConfig) -> None:
        """Raise ConfigError, naming the keys, where Megatron cannot split `model` this way."""
        rules = [
            (self.tp >= 1 and self.pp >= 1 and self.ep >= 1, "parallel.tp/pp/ep must be >= 1"),
            # Megatron gives every TP rank whole KV groups (it asserts num_query_groups % TP == 0).
            (model.n_kv_heads % self.tp == 0,
             f"parallel.tp = {self.tp} must divide model.kv_heads = {model.n_kv_heads} (Megatron "
             "gives each TP rank whole KV-head groups)"),
            (model.layers % self.pp == 0,
             f"parallel.pp = {self.pp} does not divide model.layers = {model.layers}"),
            (self.ep == 1 or (model.experts > 0 and model.experts % self.ep == 0),
             f"parallel.ep = {self.ep} must divide model.experts = {model.experts}"),
            (model.ffn_hidden % self.tp == 0 and _expert_ffn(model) % self.tp == 0,
             f"parallel.tp = {self.tp} must divide model.ffn_hidden / expert_ffn_hidden"),
        ]
        for ok, message in rules:
            if not ok:
                raise ConfigError(message)

    def padded_vocab(self, vocab: int) -> int:
        """Megatron splits the vocabulary evenly over TP; the extra rows are zero padding."""
        return -(-vocab // self.tp) * self.tp


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter (its full, un-sharded form) and the HF tensors it becomes."""

    megatron: str
    """Name in the stage-local Megatron state dict."""
    hf: tuple[str, ...]
    """HF checkpoint names, in the order the kind fuses them."""
    kind: str
    """replicated | vocab | column | row | qkv | gated: how TP splits it and how it fuses."""
    stage: int
    """Pipeline stage that holds it."""
    expert: int | None = None
    """Global expert index for routed-expert weights; their EP owner is expert // (experts / ep)."""


def hf_config(model: ModelConfig):
    """The transformers config of the HF twin: LlamaConfig (dense) or MixtralConfig (MoE)."""
    import transformers

    common = dict(
        vocab_size=model.vocab, hidden_size=model.hidden, num_hidden_layers=model.layers,
        num_attention_heads=model.heads, num_key_value_heads=model.n_kv_heads,
        max_position_embeddings=model.max_positions, rms_norm_eps=NORM_EPS, hidden_act="silu",
        tie_word_embeddings=model.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE},
    )
    # `architectures` is what vLLM picks the model class by; without it a Mixtral directory loads as a
    # non-generative model ("LLM.generate() is only supported for generative models").
    if model.experts:
        return transformers.MixtralConfig(
            intermediate_size=_expert_ffn(model), num_local_experts=model.experts,
            num_experts_per_tok=model.topk, router_jitter_noise=0.0, sliding_window=None,
            architectures=["MixtralForCausalLM"], **common)
    return transformers.LlamaConfig(intermediate_size=model.ffn_hidden, attention_bias=False, mlp_bias=False,
                                    architectures=["LlamaForCausalLM"], **common)


def _expert_ffn(model: ModelConfig) -> int:
    return model.expert_ffn_hidden or model.ffn_hidden


def entries(model: ModelConfig, layout: Layout) -> list[Entry]:
    """Every parameter of the model in export order: embedding, layers in order, final norm, head."""
    layout.check(model)
    per_stage = model.layers // layout.pp
    last = layout.pp - 1
    out = [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)]
    for layer in range(model.layers):
        stage, local = divmod(layer, per_stage)
        m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
        out += [
            Entry(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated", stage),
            Entry(m + "self_attention.linear_qkv.weight",
                  tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", stage),
            Entry(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row", stage),
            Entry(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated", stage),
        ]
        if not model.experts:
            out += [
                Entry(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                      "gated", stage),
                Entry(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row", stage),
            ]
            continue
        moe = h + "block_sparse_moe."
        out.append(Entry(m + "mlp.router.weight", (moe + "gate.weight",), "replicated", stage))
        local_experts = model.experts // layout.ep
        for e in range(model.experts):
            mx = m + f"mlp.experts.local_experts.{e % local_experts}."
            hx = moe + f"experts.{e}."
            out += [
                Entry(mx + "linear_fc1.weight", (hx + "w1.weight", hx + "w3.weight"), "gated", stage, e),
                Entry(mx + "linear_fc2.weight", (hx + "w2.weight",), "row", stage, e),
            ]
    out.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", last))
    if not model.tie_embeddings:
        out.append(Entry("output_layer.weight", ("lm_head.weight",), "vocab", last))
    return out


# --- fusing HF tensors into one Megatron tensor, and TP split/merge --------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """HF q/k/v -> Megatron's fused QKV, rows grouped per KV head: [q of group g, k_g, v_g] for g in G."""
    hidden = q.shape[1]
    head_dim = q.shape[0] // heads
    q = q.reshape(kv_heads, heads // kv_heads * head_dim, hidden)
    k = k.reshape(kv_heads, head_dim, hidden)
    v = v.reshape(kv_heads, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_qkv(fused: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """Inverse of `fuse_qkv`."""
    hidden = fused.shape[1]
    head_dim = fused.shape[0] // (heads + 2 * kv_heads)
    q_rows = heads // kv_heads * head_dim
    grouped = fused.reshape(kv_heads, q_rows + 2 * head_dim, hidden)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _split(kind: str, hf: list[torch.Tensor], model: ModelConfig, tp: int, padded_vocab: int) -> list[torch.Tensor]:
    """HF tensors of one entry -> its TP shards (contiguous copies, safe to save or load)."""
    if kind == "replicated":
        return [hf[0].clone() for _ in range(tp)]
    if kind == "vocab":
        full = hf[0]
        if padded_vocab > full.shape[0]:
            pad = full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])
            full = torch.cat([full, pad])
        return [s.clone() for s in full.chunk(tp, dim=0)]
    if kind == "column":
        return [s.clone() for s in hf[0].chunk(tp, dim=0)]
    if kind == "row":
        return [s.contiguous() for s in hf[0].chunk(tp, dim=1)]
    if kind == "qkv":
        return [s.clone() for s in fuse_qkv(*hf, model.heads, model.n_kv_heads).chunk(tp, dim=0)]
    if kind == "gated":
        gate, up = hf
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]
    raise ValueError(f"unknown parameter kind {kind!r}")


def _merge(kind: str, shards: list[torch.Tensor], model: ModelConfig) -> list[torch.Tensor]:
    """TP shards of one entry -> its HF tensors (inverse of `_split`)."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: model.vocab]]
    if kind == "column":
        return [torch.cat(shards, dim=0)]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "qkv":
        return [t.contiguous() for t in split_qkv(torch.cat(shards, dim=0), model.heads, model.n_kv_heads)]
    if kind == "gated":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown parameter kind {kind!r}")


def _ep_owner(entry: Entry, model: ModelConfig, layout: Layout) -> int | None:
    return None if entry.expert is None else entry.expert // (model.experts // layout.ep)


# --- pure conversions of full dicts ----------------------------------------------------------------

def rank_state_dict(hf: Mapping[str, torch.Tensor], model: ModelConfig, layout: Layout,
                    rank: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """The Megatron state dict of one rank (pp stage, tp rank, ep rank) cut from HF tensors.

    `hf` may be lazy (e.g. a mapping over `safe_open`): only the tensors this rank needs are read.
    """
    stage, tp_rank, ep_rank = rank
    wanted = [e for e in entries(model, layout) if e.stage == stage]
    if model.tie_embeddings and layout.pp > 1 and stage == layout.pp - 1:
        # The last stage keeps its own copy of the tied head; Megatron syncs it from the embedding.
        wanted.append(Entry("output_layer.weight", ("model.embed_tokens.weight",), "vocab", stage))
    missing = [n for entry in wanted for n in entry.hf if n not in hf]
    if missing:
        raise ConfigError(f"HF checkpoint lacks {len(missing)} tensors that model.* needs, e.g. {missing[:3]}")
    out = {}
    for entry in wanted:
        owner = _ep_owner(entry, model, layout)
        if owner is None or owner == ep_rank:
            tp_shards = _split(entry.kind, [hf[n] for n in entry.hf], model, layout.tp,
                               layout.padded_vocab(model.vocab))
            out[entry.megatron] = tp_shards[tp_rank]
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], model: ModelConfig, layout: Layout) -> Shards:
    """An HF checkpoint's tensors -> the state dict of every Megatron rank, keyed (pp, tp, ep)."""
    return {(p, t, e): rank_state_dict(hf, model, layout, (p, t, e))
            for p in range(layout.pp) for t in range(layout.tp) for e in range(layout.ep)}


def megatron_to_hf(shards: Mapping[tuple[int, int, int], Mapping[str, torch.Tensor]], model: ModelConfig,
                   layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """Every Megatron rank's state dict -> HF (name, tensor) pairs, one parameter at a time."""
    for entry in entries(model, layout):
        ep = _ep_owner(entry, model, layout) or 0
        tp_shards = [shards[(entry.stage, t, ep)][entry.megatron] for t in range(layout.tp)]
        yield from zip(entry.hf, _merge(entry.kind, tp_shards, model))


def buckets(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors into lists of at most bucket_bytes (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class SafetensorsDir(Mapping):
    """The tensors of an HF checkpoint directory (*.safetensors), read one at a time on access."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files (expected an HF checkpoint directory)")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf_into(gpt_model: torch.nn.Module, hf: Mapping[str, torch.Tensor], model: ModelConfig,
                 layout: Layout) -> None:
    """Load this rank's cut of HF tensors (e.g. a `SafetensorsDir` of the SFT checkpoint) into a live model."""
    from megatron.core import parallel_state as ps

    rank = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())
    result = gpt_model.load_state_dict(rank_state_dict(hf, model, layout, rank), strict=False)
    # Only Megatron's per-module `_extra_state` (TE/FP8 metadata, None without TE) may stay unset.
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"rank (pp, tp, ep) = {rank}: the converted checkpoint does not fit the model: "
                              f"missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")


# --- the live, collective path ---------------------------------------------------------------------

def export_hf(gpt_model: torch.nn.Module, model: ModelConfig, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF (name, tensor) pairs out of a live, sharded Megatron GPTModel.

    Collective: every trainer rank must iterate it to the end, in step. Each parameter is all-gathered
    over its TP group (the expert-TP group for experts), experts over the EP group, and broadcast from
    its pipeline stage over the PP group, so every rank sees the full stream while holding at most one
    parameter's gathered copies. Pass the bare GPTModel (not a DDP/Float16 wrapper).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = gpt_model.state_dict()
    stage = ps.get_pipeline_model_parallel_rank()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if layout.pp > 1 else []
    all_entries = entries(model, layout)
    by_expert = {(e.megatron, e.expert): e for e in all_entries if e.expert is not None}
    local_experts = model.experts // layout.ep if model.experts else 0

    def gathered(tensor: torch.Tensor, group) -> list[torch.Tensor]:
        if dist.get_world_size(group) == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return out

    for entry in all_entries:
        owner = _ep_owner(entry, model, layout)
        if owner is not None and owner > 0:
            continue  # gathered together with the same local expert of EP rank 0, below
        # Experts of the same local index on every EP rank travel in one EP all-gather.
        todo = [entry] if owner is None else [
            by_expert[(entry.megatron, r * local_experts + entry.expert)] for r in range(layout.ep)]
        pairs: list[tuple[str, torch.Tensor]] = []
        if entry.stage == stage:
            if owner is None:
                pairs = list(zip(entry.hf, _merge(entry.kind, gathered(local[entry.megatron],
                                                                       ps.get_tensor_model_parallel_group()), model)))
            else:
                per_ep = gathered(local[entry.megatron], ps.get_expert_model_parallel_group())
                for expert_entry, tensor in zip(todo, per_ep):
                    tp_shards = gathered(tensor, ps.get_expert_tensor_parallel_group())
                    pairs += zip(expert_entry.hf, _merge(expert_entry.kind, tp_shards, model))
        if layout.pp > 1:
            pairs = _broadcast_pairs(pairs, pp_ranks[entry.stage], pp_group)
        yield from pairs


def _broadcast_pairs(pairs: list[tuple[str, torch.Tensor]], src: int, group) -> list[tuple[str, torch.Tensor]]:
    """Send one parameter's HF tensors from its pipeline stage to the other stages."""
    import torch.distributed as dist

    meta = [[(name, tuple(t.shape), t.dtype) for name, t in pairs]]
    dist.broadcast_object_list(meta, src=src, group=group)
    device = pairs[0][1].device if pairs else ("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    for i, (name, shape, dtype) in enumerate(meta[0]):
        tensor = pairs[i][1].contiguous() if pairs else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=group)
        out.append((name, tensor))
    return out

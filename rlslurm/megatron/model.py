"""A Megatron-core GPTModel built from `model:` (rlslurm.modelspec.ModelConfig), on GPU or CPU.

Llama-style: RoPE, SwiGLU (gated SiLU MLP), RMSNorm, grouped-query attention, no biases; with
`model.experts > 0` every MLP is a routed MoE (Mixtral-style: softmax over the top-k router logits,
no shared expert, no auxiliary loss at inference). Embeddings tied or not per `model.tie_embeddings`.
The HF twin of this model is `convert.hf_config(model)`.

The same model on both devices: on CPU megatron-core's CUDA assumptions are answered by the shims of
rlslurm/megatron/device.py (`on_device`, `apply_cpu_shims`), and the alltoall MoE token dispatcher (it
creates a `torch.cuda.Stream`) gives way to the "allgather" one. Kernel fusions are chosen from what
imports (rlslurm/megatron/fusions.py): on a GPU without Megatron's fused softmax kernels the masked
softmax is torch's, as on CPU. `forward_logits` always passes an explicit causal mask (the fused softmax
has no causal-mask fallback).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlslurm.megatron.convert import NORM_EPS, ROPE_BASE, Layout
from rlslurm.megatron.device import apply_cpu_shims, on_device
from rlslurm.megatron.fusions import choose_fusions, flags
from rlslurm.modelspec import ModelConfig


def init_parallel(layout: Layout, seed: int = 0) -> None:
    """Megatron's TP/PP/EP groups over the already-initialized default process group, and its RNGs."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_shims()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        # Experts split over TP like the dense MLP, so one set of convert rules covers both.
        expert_tensor_parallel_size=layout.tp,
    )
    # Megatron seeds only its CUDA trackers; CPU initialisation (and the TP-replicated router and
    # norms) draws from torch's global RNG, which must then agree on every rank.
    torch.manual_seed(seed)
    # inference_rng_tracker: the default tracker forks CUDA RNG states, which CPU has none of.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())


def transformer_config(model: ModelConfig, layout: Layout, dtype: torch.dtype = torch.float32, *,
                       on_gpu: bool | None = None, **overrides):
    """Megatron's TransformerConfig for `model` split by `layout`, its fusions those whose kernels import
    (fusions.py; `on_gpu` None = whether this process sees a GPU).

    `overrides` are further TransformerConfig fields (the trainer's recompute settings)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout.check(model)
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    moe = {}
    if model.experts:
        moe = dict(
            num_moe_experts=model.experts,
            moe_router_topk=model.topk,
            moe_ffn_hidden_size=model.expert_ffn_hidden or model.ffn_hidden,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,  # top-k of logits, then softmax over them: Mixtral's routing
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
            moe_grouped_gemm=False,  # SequentialMLP: one module per expert, one HF name each
        )
    kwargs = dict(
        num_layers=model.layers,
        hidden_size=model.hidden,
        num_attention_heads=model.heads,
        num_query_groups=model.n_kv_heads,
        ffn_hidden_size=model.ffn_hidden,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=NORM_EPS,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # activations sent between stages
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        **flags(choose_fusions(on_gpu=on_gpu)),
        **moe,
    )
    return TransformerConfig(**{**kwargs, **overrides})


def build_gpt_model(model: ModelConfig, layout: Layout, dtype: torch.dtype = torch.float32, *,
                    parallel_output: bool = False, **config_overrides):
    """This rank's pipeline stage of the GPTModel; `init_parallel(layout)` must have run.

    parallel_output=False gathers the full logits on every TP rank (greedy decode, comparisons); a
    trainer that passes `labels` needs True: Megatron's vocab-parallel cross entropy expects each TP
    rank's own vocabulary slice, and on gathered logits it would be wrong at TP > 1."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(model, layout, dtype, **config_overrides)
    # The local (non-TE) spec: its state-dict names are the ones convert.py maps.
    spec = get_gpt_layer_local_spec(num_experts=model.experts or None, normalization="RMSNorm")
    with on_device():
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=layout.padded_vocab(model.vocab),
            max_sequence_length=model.max_positions,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(ROPE_BASE),
        )
    return gpt.to("cuda" if torch.cuda.is_available() else "cpu")


def forward_logits(gpt, token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits [batch, seq, vocab] of a single-stage (PP=1) GPTModel; collective over its TP group."""
    batch, seq = token_ids.shape
    device = next(gpt.parameters()).device
    token_ids = token_ids.to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    # True = masked out (Megatron's convention): the future of every position.
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    logits = gpt(token_ids, positions, causal)
    return logits[..., :vocab]  # drop TP vocab padding


@torch.no_grad()
def greedy_generate(gpt, prompt_ids: torch.Tensor, new_tokens: int, vocab: int) -> torch.Tensor:
    """Greedy continuation without a KV cache (a reference decoder, not a fast one)."""
    gpt.eval()
    ids = prompt_ids
    for _ in range(new_tokens):
        next_id = forward_logits(gpt, ids, vocab)[:, -1].argmax(-1, keepdim=True).to(ids.device)
        ids = torch.cat([ids, next_id], dim=1)
    return ids

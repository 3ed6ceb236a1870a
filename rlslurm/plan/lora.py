"""LoRA in the plan (train.lora, rlslurm/lora.py): the adapters' parameters, and the terms they change.

    n = adapter_params(job.model, job.train.lora)    # rank x (in + out) per target linear layer of every block
    trainer_memory(..., adapters=n)                  # gradients, Adam and DDP buckets of the adapters alone
    sync_weights(weights, job)                       # a step's sync moves the adapters (transformers engine)

With LoRA the base weights are frozen: they hold no gradient, no optimizer state and no DDP bucket
(rlslurm/plan/memory.py counts those for the adapters alone), their weight-gradient matmuls are skipped in
the backward pass (rlslurm/plan/compute.py: 2 passes of the forward's FLOPs instead of 3; the input
gradients still flow through every layer), and the activations stay what they were: the backward still
needs each layer's input (an adapter's own rank-r intermediate is under 1 % of a layer's). A weight sync to
the transformers engine sends the adapters; vLLM is sent the merged model, the full bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlslurm.modelspec import ModelConfig
from rlslurm.plan.quantity import Q, gb, params

if TYPE_CHECKING:
    from rlslurm.config import JobConfig


def target_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one Llama block (dense MLP), by its module name."""
    q, kv = m.heads * m.dim_per_head, m.n_kv_heads * m.dim_per_head
    return {"q_proj": (m.hidden, q), "k_proj": (m.hidden, kv), "v_proj": (m.hidden, kv), "o_proj": (q, m.hidden),
            "gate_proj": (m.hidden, m.ffn_hidden), "up_proj": (m.hidden, m.ffn_hidden),
            "down_proj": (m.ffn_hidden, m.hidden)}


def adapter_params(m: ModelConfig, lora) -> float:
    """Parameters of the LoRA adapters: A [rank, in] and B [out, rank] on each target of every block."""
    if not lora.enabled:
        return 0.0
    shapes = target_shapes(m)
    return float(m.layers * sum(lora.rank * sum(shapes[t]) for t in lora.targets if t in shapes))


def job_adapter_params(job: "JobConfig") -> float | None:
    """The adapters' parameters of a torch trainer with train.lora; None for full fine-tuning."""
    if not job.train.lora.enabled or job.train.backend != "torch":
        return None
    return adapter_params(job.model, job.train.lora)


def sync_weights(weights: Q, job: "JobConfig") -> Q:
    """What one step's weight sync moves: the adapters with train.lora on the transformers engine, else `weights`
    (vLLM is sent the merged model)."""
    n = job_adapter_params(job)
    if n is None or job.rollout.engine != "hf" or job.sync.weights_gb is not None:
        return weights
    return Q("weights", gb(n * 4), "GB", f"{params(n)} LoRA adapter params x 4 B (fp32, the transformers engine's)")

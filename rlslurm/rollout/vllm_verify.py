"""VERIFY inside vLLM's workers: checksums of what each worker *serves*, under Hugging Face names.

    vllm serve DIR --worker-extension-cls rlslurm.rollout.vllm_verify.WorkerChecks   # (rollout/vllm_serve.py)
    POST /collective_rpc {"method": "rlslurm_checksums"}                            # (rollout/vllm_client.py)

Runs in vLLM's worker processes (the vLLM venv), mixed into the worker by `--worker-extension-cls`:

  - a fused `qkv_proj` is cut back into q/k/v rows, `gate_up_proj` into gate/up, the padded vocab rows are
    dropped, and a linear layer whose weight the CPU backend packed away (the parameter then holds nothing)
    is read back by pushing the identity through its own GEMM: exact in fp32, each output is one weight
    times 1 plus zeros. So a layer whose parameters are new but whose packed copy (what the forward pass
    uses) is old reads as old: a half-applied update is named, not served;
  - a tied embedding is served twice (lookup table and the LM head's GEMM): both copies are checksummed,
    and two copies that disagree are reported as such;
  - at TP > 1 each served shard is gathered across the TP workers (vLLM's own TP group: weight bytes pass
    only between vLLM's workers) into the Hugging Face tensor, whose checksum is then comparable with the
    trainer's. A stale or corrupted shard on any one rank changes that tensor's checksum (on every rank).

Why not vLLM's /weight_checker: see rollout/vllm_client.py. Covers Llama-family layouts; MoE expert weights
(prepacked by the CPU backend into a layout of its own) are not read: VERIFY reports them missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_PROBE_ROWS = 1024  # identity rows per GEMM call when reading a packed weight back (bounds the temporary)


@dataclass
class _Use:
    """One place the model serves (part of) a Hugging Face tensor from."""

    name: str
    """Hugging Face name, e.g. model.layers.0.self_attn.k_proj.weight."""
    module: torch.nn.Module
    attr: str
    """Parameter of `module` that holds it ("weight", "bias")."""
    rows: slice
    """Rows of that parameter that are this tensor (fused projections, padded vocab)."""
    through_gemm: bool
    """Read through the layer's (possibly packed) GEMM rather than from the parameter."""


def _served_uses(model: torch.nn.Module) -> list[_Use]:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    canonical: dict[int, str] = {}
    for name, p in model.named_parameters():  # first name of a tied parameter wins, like HF's state_dict
        canonical.setdefault(id(p), name)
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    lm_head = getattr(model, "lm_head", None)
    uses: list[_Use] = []
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            full = canonical[id(p)]
            prefix = full.rsplit(".", 1)[0]
            leaf = full.rsplit(".", 1)[1]
            gemm = (attr == "weight" and hasattr(module, "cpu_linear")
                    and (isinstance(module, LinearBase) or module is lm_head))
            if isinstance(module, VocabParallelEmbedding):
                # vLLM pads the vocab (to a multiple of 64); the checkpoint has org_vocab_size rows.
                if module.tp_size != 1:
                    raise NotImplementedError("_served_uses reads TP size 1; TP > 1 goes through _tp_served")
                rows = slice(0, module.org_vocab_size)
                uses.append(_Use(full, module, attr, rows, gemm and isinstance(module, ParallelLMHead)))
                if gemm and not isinstance(module, ParallelLMHead):  # the embedding doubles as the LM head
                    uses.append(_Use(full, module, attr, rows, True))
                continue
            parent, _, short = prefix.rpartition(".")
            if short in packed and hasattr(module, "output_sizes") and attr in ("weight", "bias"):
                tp = getattr(module, "tp_size", 1)
                if tp != 1:
                    raise NotImplementedError("_served_uses reads TP size 1; TP > 1 goes through _tp_served")
                start = 0
                for sub, size in zip(packed[short], module.output_sizes):
                    hf = f"{parent}.{sub}.{leaf}" if parent else f"{sub}.{leaf}"
                    uses.append(_Use(hf, module, attr, slice(start, start + size), gemm))
                    start += size
                continue
            uses.append(_Use(full, module, attr, slice(None), gemm))
    return uses


def _gemm_weight(module: torch.nn.Module) -> torch.Tensor:
    """The [out, in] weight a linear layer's GEMM applies, read back through the GEMM itself.

    Exact for finite weights except the sign of a zero: -0.0 reads back as +0.0 (a false VERIFY
    alarm, never a missed one), as would inf/nan turn into nan.
    """
    param = module.weight
    k = next(getattr(module, a) for a in ("input_size_per_partition", "input_size", "embedding_dim")
             if getattr(module, a, None))
    rows = []
    for start in range(0, k, _PROBE_ROWS):
        eye = torch.zeros(min(_PROBE_ROWS, k - start), k, dtype=param.dtype, device=param.device)
        eye[:, start : start + eye.shape[0]].fill_diagonal_(1)
        rows.append(module.cpu_linear(eye, param, None))
    return torch.cat(rows).t().contiguous()


def _read(use: _Use, cache: dict) -> torch.Tensor:
    key = (id(use.module), use.attr, use.through_gemm)
    if key not in cache:
        cache[key] = _gemm_weight(use.module) if use.through_gemm else getattr(use.module, use.attr).detach()
    return cache[key][use.rows]


def _served(model) -> dict[str, list[torch.Tensor]]:
    """Every served copy of every HF tensor (a tied embedding is served twice: lookup and LM head)."""
    cache: dict = {}
    out: dict[str, list[torch.Tensor]] = {}
    for use in _served_uses(model):
        out.setdefault(use.name, []).append(_read(use, cache))
    return out


class WorkerChecks:
    """Mixed into vLLM's worker (`--worker-extension-cls`); called by name through `/collective_rpc`."""

    @torch.no_grad()
    def rlslurm_checksums(self) -> dict[str, str]:
        """Checksums of what is served; a tensor whose served copies disagree gets both, so it mismatches."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        from rlslurm.sync.checksum import tensor_checksum

        model = self.model_runner.get_model()
        served = _served(model) if get_tensor_model_parallel_world_size() == 1 else _tp_served(model)
        out = {}
        for name, copies in served.items():
            sums = sorted({tensor_checksum(t) for t in copies})
            out[name] = sums[0] if len(sums) == 1 else "inconsistent copies: " + " | ".join(sums)
        return out

    def rlslurm_debug(self, skip_retie: str) -> bool:
        """Tests only: the next updates leave a tied LM head's packed GEMM on the old weights (rollout/vllm_transfer.py
        DEBUG), a real half-applied update that VERIFY must name. Behind the job's secret like every route; vLLM's
        /collective_rpc passes string arguments only ("1" / "0")."""
        from rlslurm.rollout import vllm_transfer

        vllm_transfer.DEBUG["skip_retie"] = skip_retie == "1"
        return vllm_transfer.DEBUG["skip_retie"]


def _tp_served(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Every served copy of every HF tensor, each gathered whole across the TP group (Llama-family layouts:
    column-parallel rows, row-parallel columns, vocab-parallel rows, fused q/k/v and gate/up per rank)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
    from vllm.model_executor.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor_model_parallel_all_gather(t.contiguous(), dim)

    tp = get_tensor_model_parallel_world_size()
    canonical: dict[int, str] = {}
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    lm_head = getattr(model, "lm_head", None)
    out: dict[str, list[torch.Tensor]] = {}
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            full = canonical[id(p)]
            prefix, leaf = full.rsplit(".", 1)
            gemm = (attr == "weight" and hasattr(module, "cpu_linear")
                    and (isinstance(module, LinearBase) or module is lm_head))
            if isinstance(module, VocabParallelEmbedding):
                # Rank r holds padded-vocab rows [r * n, (r + 1) * n); the checkpoint's are the first org_vocab_size.
                head = isinstance(module, ParallelLMHead)
                reads = [gemm and head] + [True] * (gemm and not head)  # a tied embedding: lookup + LM-head GEMM
                for through_gemm in reads:
                    local = _gemm_weight(module) if through_gemm else p.detach()
                    out.setdefault(full, []).append(gather(local, 0)[: module.org_vocab_size])
                continue
            local = _gemm_weight(module) if gemm else p.detach()
            parent, _, short = prefix.rpartition(".")
            if short in packed and hasattr(module, "output_sizes") and attr in ("weight", "bias"):
                if isinstance(module, QKVParallelLinear):
                    if getattr(module, "num_kv_head_replicas", 1) != 1:
                        raise NotImplementedError("VERIFY at TP > KV heads (replicated KV heads) is not covered")
                    sizes = [module.num_heads * module.head_size] + [module.num_kv_heads * module.head_size] * 2
                else:
                    sizes = [size // tp for size in module.output_sizes]
                start = 0
                for sub, size in zip(packed[short], sizes):
                    hf = f"{parent}.{sub}.{leaf}" if parent else f"{sub}.{leaf}"
                    out.setdefault(hf, []).append(gather(local[start : start + size], 0))
                    start += size
                continue
            if isinstance(module, RowParallelLinear):
                out.setdefault(full, []).append(gather(local, 1) if attr == "weight" else local)
            elif isinstance(module, LinearBase):  # column-parallel
                out.setdefault(full, []).append(gather(local, 0))
            else:  # norms: replicated
                out.setdefault(full, []).append(local)
    return out

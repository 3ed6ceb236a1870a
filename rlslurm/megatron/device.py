"""Where Megatron-core computes: the rank's GPU, or the CPU through a small documented shim set.

    with on_device():                      # every call into Megatron's model, DDP, optimizer and schedule
        ddp, optimizer = build_trainer(...)

One code path: the trainer (rlslurm/megatron/trainer.py) and the RL policy (policy.py) run Megatron's own
GPTModel, DistributedDataParallel (grad buffers, bucketed reduce-scatter), DistributedOptimizer (fp32 master
shards, Adam) and pipeline schedule on the GPU under NCCL, and the same objects on the CPU under gloo in CI.
megatron-core 0.16.1 assumes CUDA in a few places that are not about computing; on a machine without CUDA
they are answered here, and nowhere else:

1. `torch.cuda.current_device()` is the device of Megatron's buffers (the global memory buffer,
   distributed/param_and_grad_buffer.py's `param_data`/`grad_data`, the optimizer's shard buffers) -> "cpu"
   (`apply_cpu_shims`, process-wide, idempotent).
2. The MoE router tests `te_general_gemm is not None`, a name bound only when Transformer Engine imports
   -> None (`apply_cpu_shims`).
3. Activation recompute (tensor_parallel/random.py's `CheckpointFunction`, `memory.recompute` selective or
   full) saves and restores the CPU RNG state and the CUDA one (`_get_cuda_rng_state`,
   `_set_cuda_rng_state`), so that a recomputed dropout draws what the forward drew. A CPU tensor draws
   from the CPU generator, which it already saves and restores: the CUDA pair -> the CPU state and a no-op
   (`apply_cpu_shims`).
4. Literal `device="cuda"` in tensors Megatron makes for bookkeeping: optimizer/optimizer.py's
   `_dummy_overflow_buf`, `found_inf`, `_scale_one`; optimizer/clip_grads.py's norm reduction;
   pipeline_parallel/schedules.py's `total_num_tokens`; and `Tensor.cuda()` (a tied LM head on the
   last PP stage in models/common/language_module/language_module.py) -> the CPU (`on_device`, a TorchFunctionMode).
5. Type checks by name: optimizer/optimizer.py (`Float16OptimizerWithFloat16Params`),
   optimizer/distrib_optimizer.py (`_build_model_and_main_param_groups`, and its `main_param_sharded`
   marking) and optimizer/clip_grads.py (`assert param.grad.type() == 'torch.cuda.FloatTensor'`) accept
   only 'torch.cuda.{Float,Half,BFloat16}Tensor' and raise TypeError otherwise -> under `on_device`, a
   CPU tensor's `.type()` answers with the CUDA name of its dtype, so those checks sort it as they sort
   the GPU tensor it stands for (nothing else reads the name).

What stays CUDA-only, and is not used by rlslurm: CUDA streams (distributed_data_parallel.py and
param_and_grad_buffer.py create one only with `num_distributed_optimizer_instances > 1`), CUDA graphs,
NCCL user buffers (`nccl_ub`), CPU offload of the optimizer, Transformer Engine and Apex kernels (their
fusions are chosen off by rlslurm/megatron/fusions.py where they do not import). gloo carries every
collective Megatron's DDP and distributed optimizer issue here (all-reduce, reduce-scatter, all-gather,
coalesced), async ones included (`overlap_grad_reduce`).
On a GPU, `on_device` is a null context and `apply_cpu_shims` returns at once: nothing is patched.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def apply_cpu_shims() -> None:
    """Shims 1, 2 and 3 above, process-wide, where no GPU is visible (idempotent)."""
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.tensor_parallel.random as megatron_random
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None


def _cpu_for_cuda(device):
    """`device` with any CUDA device replaced by the CPU (an int is a CUDA ordinal)."""
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CudaOnCpu(TorchFunctionMode):
    """Shims 4 and 5 above: CUDA tensors Megatron makes for bookkeeping are made on the CPU, and a CPU
    tensor's `.type()` names the CUDA tensor type it stands for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cpu_for_cuda(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def on_device():
    """The context every call into Megatron's model, DDP, optimizer and schedule runs in: nothing on a GPU,
    the CPU shims 4 and 5 without one (thread-local: it covers the calling thread, where the schedule
    runs forward and backward)."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    apply_cpu_shims()
    return _CudaOnCpu()

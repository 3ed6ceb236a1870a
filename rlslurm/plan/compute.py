"""Seconds of the train and rollout phases, counted from the shape and the device's speed, not guessed.

    speed = device_speed(job.hardware)                  # GPU: vendor FLOP/s x timing.mfu; cpu: this machine's
    train = train_seconds(job, counts, dp, speed)       # one step's optimizer work on a rank: FLOPs + ops
    roll = rollout_seconds(job, counts, engines, speed) # one step's generation: prefill + decode steps

A step's time is arithmetic over its work and a speed, each shown: FLOPs (2 per multiply-add of every matrix a
token meets: rlslurm/plan/recompute.py's count) at the device's matmul FLOP/s, plus the ops it runs at the
device's per-op floor. The floor matters for small models: the embedded model's step is ~700 ops of tiny
tensors, where a GPU's kernel launch or a CPU's dispatch (~7 us) outweighs the arithmetic.

train (per rank, one RL step or SFT optimizer step): tokens = the rank's sequences x parallel.seq_len, each
  through forward (1) + backward (2) + what redoes work: recompute (recompute.py), fused CE's second LM-head pass,
  the RL update's no-grad forward for the behaviour log-probs with rl.mini_batches > 1 (one mini-batch takes them
  from the training forward: rlslurm/rl/config.py `behaviour_forward`), the reference's with rl.kl_coef;
  ops = per micro-batch 193 per layer + 76 around them, per optimizer step 12 per parameter tensor (counted on
  the embedded Llama with a dispatch counter, tests/unit/test_plan_compute.py); and the elementwise work's bytes:
  the activations (rlslurm/plan/activations.py) moved TRAFFIC_PASSES times at the device's copy bandwidth.
rollout (per engine): ceil(sequences / rows per batch) batches of prefill (prompt tokens) and
  rollout.max_new_tokens decode steps; a decode step reads the weights once (HBM-bound on a GPU) and computes
  2 x active params per row; on the CPU every step also pays ~25 ops per layer.
A run measures each phase; `rlslurm plan --from-run` scales each of these by measured / planned
(rlslurm/plan/calibration.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlslurm.modelspec import ParamCounts
from rlslurm.plan.activations import activations
from rlslurm.plan.decode import ROLLOUT_WEIGHT_BYTES
from rlslurm.plan.hardware import HardwareConfig
from rlslurm.plan.quantity import Q, num, params
from rlslurm.plan.recompute import forward_flops, recompute_factor
from rlslurm.rl.config import behaviour_forward

if TYPE_CHECKING:
    from rlslurm.config import JobConfig

OPS_PER_LAYER = 193
"""Ops of one layer's forward + backward in the torch trainer (transformers' Llama, SDPA), counted."""
OPS_AROUND = 76
"""Ops of one micro-batch outside the layers: embedding, final norm, LM head, log-probs, loss."""
OPS_PER_PARAM_TENSOR = 12
"""Ops of one parameter tensor's AdamW update (torch's single-tensor path on the CPU)."""
DECODE_OPS_PER_LAYER = 25
"""Ops of one layer in one decode step (KV-cache append, attention, MLP)."""
GPU_OP_S = 10e-6
"""A GPU kernel's launch floor, seconds."""
TRAFFIC_PASSES = 4
"""Times a step moves each activation byte: written and read forward, its gradient written and read backward."""
LOGIT_PASSES = {"plain": 12, "fused": 14}
"""Times a step moves the fp32 logits: the plain path's log-softmax, gather and their gradients; the fused path's
max, exp and sum forward, and the recomputed chunk's exp, scale and index backward."""


@dataclass(frozen=True)
class DeviceSpeed:
    """What one trainer rank (or engine GPU) does per second."""

    flops: float
    """Matmul FLOP/s a step reaches: GPU peak x timing.mfu; cpu: one thread's measured fp32 rate."""
    op_s: float
    """Seconds of one small op (the floor under every op)."""
    hbm_gb_s: float
    """Memory bandwidth a decode step reads the weights at."""
    copy_gb_s: float
    """Bandwidth elementwise work moves activations at (cpu: one thread's measured copy; GPU: HBM)."""
    how: str


def device_speed(hw: HardwareConfig, mfu: float) -> DeviceSpeed:
    """The vendor's figures for a GPU profile; this machine's, measured (rlslurm/plan/machine.py), for cpu."""
    if hw.profile == "cpu":
        from rlslurm.plan.machine import cpu_speed

        measured = cpu_speed()
        gflops = hw.cpu_matmul_gflops or measured.matmul_gflops
        op_us = hw.cpu_op_overhead_us or measured.op_overhead_us
        copy = hw.cpu_copy_gb_s or measured.copy_gb_s
        source = "hardware.cpu_*" if hw.cpu_matmul_gflops else measured.source
        return DeviceSpeed(gflops * 1e9, op_us * 1e-6, copy, copy,
                           f"this machine: {gflops:g} GFLOP/s fp32 per thread, {op_us:g} us per op, "
                           f"{copy:g} GB/s ({source})")
    peak = hw.matmul_tflops * 1e12
    return DeviceSpeed(peak * mfu, GPU_OP_S, hw.hbm_tb_s * 1000, hw.hbm_tb_s * 1000,
                       f"{hw.profile}: {hw.matmul_tflops:g} TFLOP/s bf16 x timing.mfu {mfu:g}, "
                       f"{hw.hbm_tb_s:g} TB/s HBM")


def train_seconds(job: "JobConfig", counts: ParamCounts, dp: int, speed: DeviceSpeed) -> Q:
    """One step's optimizer work on one rank (module docstring)."""
    m, p, memory = job.model, job.parallel, job.resolved_memory
    if job.job.kind == "rl":
        sequences = job.rl.prompts_per_step * job.rl.samples_per_prompt
        optimizer_steps = job.rl.mini_batches
    else:
        sequences, optimizer_steps = job.train.batch_size, 1
    per_rank = sequences / dp
    micro = math.ceil(per_rank / (p.micro_batch_size * optimizer_steps)) * optimizer_steps
    tokens = per_rank * p.seq_len / (p.tp * p.cp * p.pp)
    f = forward_flops(m, p)
    # forward + backward (input and weight gradients); train.lora skips the frozen weights' gradients
    base = 2.0 if job.train.lora.enabled and job.train.backend == "torch" else 3.0
    passes = base * recompute_factor(m, p, memory.recompute).value
    what = [f"{base:g} x recompute {memory.recompute}" + (" (LoRA: no frozen weight gradients)" if base == 2 else "")]
    if memory.fused_ce:
        passes += f.head.value / f.total.value
        what.append("fused CE's LM head again")
    behaviour = job.job.kind == "rl" and behaviour_forward(job.rl.mini_batches)
    if job.job.kind == "rl" and (behaviour or job.rl.kl_coef > 0):
        passes += behaviour + (job.rl.kl_coef > 0)
        what.append(" + ".join(["behaviour forward"] * behaviour + ["reference forward"] * (job.rl.kl_coef > 0)))
    flops = tokens * f.total.value * 1e6 * passes
    tensors = 9 * m.layers + 2 + (0 if m.tie_embeddings else 1)
    ops = micro * (OPS_PER_LAYER * m.layers + OPS_AROUND) + optimizer_steps * OPS_PER_PARAM_TENSOR * tensors
    if behaviour:
        ops += micro * (OPS_PER_LAYER * m.layers + OPS_AROUND) // 3  # the behaviour forward
    # Elementwise work moves bytes, not FLOPs: each activation is written and read in the forward pass, its
    # gradient written and read in the backward one (x TRAFFIC_PASSES); the fp32 logits (every token x vocab,
    # however the fused path chunks them) pass LOGIT_PASSES times; all at the device's copy bandwidth.
    acts = activations(m, p, memory, job.train.backend)
    layer_bytes = micro * (acts.layers.value + acts.around.value) * 1e9
    logit_bytes = micro * p.micro_batch_size * p.seq_len * m.vocab * 4 / p.tp
    logit_passes = LOGIT_PASSES["fused" if memory.fused_ce else "plain"]
    traffic = layer_bytes * TRAFFIC_PASSES + logit_bytes * logit_passes
    seconds = flops / speed.flops + ops * speed.op_s + traffic / (speed.copy_gb_s * 1e9)
    return Q("train step", seconds, "s",
             f"{num(tokens)} tokens per rank x forward {f.total.text()} x ({' + '.join(what)} = {passes:.3g} "
             f"passes) / {num(speed.flops / 1e9)} GFLOP/s + {ops:,} ops x {speed.op_s * 1e6:.3g} us + (activations "
             f"{num(layer_bytes / 1e9)} GB x {TRAFFIC_PASSES} + logits {num(logit_bytes / 1e9)} GB x {logit_passes}) "
             f"/ {num(speed.copy_gb_s)} GB/s")


def rollout_seconds(job: "JobConfig", counts: ParamCounts, engines: int, speed: DeviceSpeed,
                    prompt_tokens: float | None = None) -> Q:
    """One step's generation over `engines` engines (module docstring); `prompt_tokens` per prompt (default:
    parallel.seq_len less rollout.max_new_tokens)."""
    m, r = job.model, job.rollout
    sequences = job.rl.prompts_per_step * job.rl.samples_per_prompt
    per_engine = math.ceil(sequences / max(engines, 1))
    rows = min(per_engine, r.max_batch_rows or per_engine)
    batches = math.ceil(per_engine / rows)
    prompt = prompt_tokens if prompt_tokens is not None else max(1, job.parallel.seq_len - r.max_new_tokens)
    active = counts.active / r.tp
    step_flops = rows * 2 * active
    if job.hardware.profile == "cpu":
        step = step_flops / speed.flops + DECODE_OPS_PER_LAYER * m.layers * speed.op_s
        how_step = (f"rows {rows} x 2 x {params(active)} active / {num(speed.flops / 1e9)} GFLOP/s + "
                    f"{DECODE_OPS_PER_LAYER} ops x {m.layers} layers x {speed.op_s * 1e6:.3g} us")
    else:
        read = active * ROLLOUT_WEIGHT_BYTES / (speed.hbm_gb_s * 1e9)
        step = max(read, step_flops / speed.flops) + DECODE_OPS_PER_LAYER * m.layers * speed.op_s
        how_step = f"max(weights {params(active)} x 2 B / HBM, rows {rows} x 2 x active / FLOP/s) + launches"
    prefill = rows * prompt * 2 * active / speed.flops
    seconds = batches * (prefill + r.max_new_tokens * step)
    return Q("rollout", seconds, "s",
             f"{batches} batch(es) x (prefill {rows} x {num(prompt)} prompt tokens {num(prefill)} s + "
             f"max_new_tokens {r.max_new_tokens} x step {num(step)} s [{how_step}]) per engine")

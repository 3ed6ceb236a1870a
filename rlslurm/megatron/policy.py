"""`train.backend = megatron`: the RL policy on Megatron-core, beside rlslurm/rl/policy.py's torch Policy.

    policy = MegatronPolicy(job, topo, model_dir)      # rlslurm/rl/loop.py's make_policy picks it by train.backend
    stats = policy.update(samples, guard)              # rl.mini_batches clipped GRPO steps (memory: policy.meter)
    weights = policy.weights()                         # rank 0: {HF name: fp32 tensor}, what the engines serve

The same interface as the torch Policy, so the RL loop does not know which one trains:
  - `update(samples, guard)` makes the same clipped objective (rlslurm/rl/objective.py, every rl: switch)
    on the same split (rlslurm/rl/batches.py: rl.mini_batches optimizer steps, forwards of
    parallel.micro_batch_size; tests/integration/test_megatron_policy.py holds it to the torch Policy's
    loss) through Megatron's DDP, distributed optimizer and schedule (rlslurm/megatron/trainer.py). Every
    rank takes every optimizer step, also one where its share is empty (a zero-weight row stands in), so
    no rank's weights fall behind.
  - `weights()` are the HF-named tensors of convert.export_hf, gathered over TP by every rank at the end
    of `update` (the RL loop asks rank 0 alone, and export_hf is collective) and kept on rank 0's device
    as fp32, the dtype the engines serve (rollout server's --dtype float32) and VERIFY compares.
  - `model` is an HF view (`HFView`): rlslurm/rl/checkpointing.py loads a checkpoint's HF tensors into it (every rank)
    and exports it with `save_hf` (rank 0). `optimizer` checkpoints the step count (rank 0) and, through
    `save_shards` on every rank, its share of Adam's moments and of the fp32 master weights.

The model's shape is read from the checkpoint's config.json (what train.init_from or the random init
wrote), with its RMSNorm epsilon; precision, recompute and the distributed optimizer follow `memory:`,
so the plan's memory prediction describes the trainer that runs (bench/gpu_smoke.py compares them).

One code path: on a GPU under NCCL, and on the CPU under gloo (CI), the same Megatron DDP, distributed
optimizer and schedule run (every call inside rlslurm/megatron/device.py's `on_device`, which answers
megatron-core's CUDA assumptions on CPU). Memory per phase is measured as the torch policy's
(rlslurm/memory_meter.py: the GPU allocator's peaks, or the live-tensor meter on the CPU); memory.fused_ce
takes the decoder's hidden states through rlslurm/logprobs.py's chunked LM head (`token_nll`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from rlslurm.config_rules import megatron_rules
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import bind_local_gpu, compute_device
from rlslurm.errors import ConfigError
from rlslurm.megatron.device import on_device
from rlslurm.megatron.optimizer_state import OptimizerState
from rlslurm.megatron.trainer import token_nll
from rlslurm.memory_meter import MemoryMeter, owned_tensors
from rlslurm.modelspec import ModelConfig
from rlslurm.plan.memory import resolve
from rlslurm.plan.parallel import trainer_rules
from rlslurm.rl.batches import micro_batch_counts, micro_batches, mini_batches, share_sizes
from rlslurm.rl.config import behaviour_forward
from rlslurm.rl.experience import Sample
from rlslurm.rl.objective import Objective, Packed, UpdateStats, behaviour_logprobs, divisors, pack
from rlslurm.rl.policy import RLPolicy

log = logging.getLogger(__name__)


def _value(job, key: str):
    for part in key.split("."):
        job = getattr(job, part)
    return job


def train_config(job):
    """MegatronTrainConfig from `memory:` (the planner's knobs are the trainer's knobs)."""
    from rlslurm.megatron.trainer import MegatronTrainConfig

    memory = resolve(job.memory, "megatron", job.hardware.profile)  # this trainer's, whatever train.backend says
    return MegatronTrainConfig(bf16=memory.weight_bytes == 2.0, recompute=memory.recompute,
                               distributed_optimizer=memory.distributed_optimizer)


def build_metered_trainer(state, job, norm_eps: float, weights) -> None:
    """The Megatron trainer of `state` (the RL policy's and the SFT state's alike): its parallel layout and groups,
    DDP and distributed optimizer on `state.spec`, started from `weights` (an HF checkpoint's tensors, a dict or a
    SafetensorsDir, loaded into the bare GPTModel), built under the state's memory meter."""
    from rlslurm.megatron.convert import Layout, load_hf_into
    from rlslurm.megatron.model import init_parallel
    from rlslurm.megatron.trainer import build_trainer

    state.layout = Layout(tp=job.parallel.tp)
    init_parallel(state.layout, seed=job.train.seed)
    state.distributed_optimizer = train_config(job).distributed_optimizer
    state.meter = MemoryMeter(state.device, job.diag.memory_every_steps, owned=state._owned)
    with state.meter.tracking():  # Megatron's grad buffers and fp32 master weights: held all run
        state.ddp, state.megatron_optimizer = build_trainer(
            state.spec, state.layout, train_config(job), lr=job.train.lr, grad_clip=job.train.grad_clip,
            weight_decay=job.train.weight_decay, layernorm_epsilon=norm_eps,
            init=lambda gpt: load_hf_into(gpt, weights, state.spec, state.layout))
    state.gpt = state.ddp.module


def hf_model_spec(model_dir: str | Path) -> tuple[ModelConfig, float]:
    """(ModelConfig, RMSNorm epsilon) of the Llama checkpoint in model_dir, read from its config.json."""
    path = Path(model_dir) / "config.json"
    return spec_from_config(json.loads(path.read_text()), name=Path(model_dir).name, where=str(path))


def spec_from_config(cfg: dict, *, name: str, where: str) -> tuple[ModelConfig, float]:
    """(ModelConfig, RMSNorm epsilon) of an HF Llama config (`where` names it in errors)."""
    from rlslurm.megatron.convert import ROPE_BASE

    if cfg.get("model_type") != "llama":
        raise ConfigError(f"{where}: model_type {cfg.get('model_type')!r}; the Megatron trainer trains Llama-layout "
                          "checkpoints (the embedded model, SmolLM2): set train.backend = torch")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", ROPE_BASE))
    if head_dim * heads != hidden or float(rope) != ROPE_BASE or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: head_dim {head_dim} x heads {heads} != hidden {hidden}, rope_theta {rope} != "
                          f"{ROPE_BASE}, or biases: rlslurm/megatron/convert.py maps none of these yet")
    spec = ModelConfig(name=name, layers=cfg["num_hidden_layers"], hidden=hidden, heads=heads,
                       kv_heads=cfg.get("num_key_value_heads") or heads, ffn_hidden=cfg["intermediate_size"],
                       vocab=cfg["vocab_size"], max_positions=cfg["max_position_embeddings"],
                       tie_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    return spec, float(cfg.get("rms_norm_eps", 1e-6))


# -- the model's log-probabilities (the objective itself is rlslurm/rl/objective.py's, shared with torch) --

def token_logprobs(gpt, tokens: torch.Tensor, labels: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
    """log p(labels[:, t] | tokens[:, :t+1]) from a Megatron GPTModel (PP = 1); collective over its TP group."""
    with on_device():
        return -token_nll(gpt, tokens, labels, fused=fused).float()


def megatron_owned(gpt, megatron_optimizer) -> list[torch.Tensor]:
    """What a Megatron rank holds between steps: weights, Megatron's main grads, the optimizer's master
    weights and moments (the CPU memory meter seeds them; rlslurm/memory_meter.py)."""
    out = owned_tensors(gpt)
    out += [p.main_grad for p in gpt.parameters() if getattr(p, "main_grad", None) is not None]
    for chained in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is not None:
            out += owned_tensors(optimizer=inner)
            out += [p for group in inner.param_groups for p in group["params"]]
    return out


# -- the policy -----------------------------------------------------------------------------------------

class MegatronPolicy(RLPolicy):
    """The trained GPTModel (Megatron DDP + distributed optimizer) on this rank's device."""

    def __init__(self, job, topo, model_dir: str | Path):
        from transformers import AutoTokenizer

        from rlslurm.megatron.convert import SafetensorsDir

        for key, message in megatron_rules(job):  # JobConfig refused these at load; a hand-built job may not have
            raise ConfigError(f"{key} = {_value(job, key)!r} {message}")
        for key, message in trainer_rules("megatron", job.parallel, job.model.experts):  # submit's pre-flight too
            raise ConfigError(f"{key} {message}")
        if torch.cuda.is_available():
            bind_local_gpu(topo.local_rank)  # its own GPU, or an error naming why it has none
        self.device = compute_device()  # that GPU, else the CPU (gloo: rlslurm/megatron/device.py)
        self.job, self.topo, self.model_dir = job, topo, Path(model_dir)
        self.objective = Objective.of(job)
        self.spec, norm_eps = hf_model_spec(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        build_metered_trainer(self, job, norm_eps, SafetensorsDir(model_dir))
        self.steps = 0
        self._hf: dict[str, torch.Tensor] = {}
        self._export()
        self.model = HFView(self)
        self.optimizer = OptimizerState(self)
        log.info("megatron policy on %s: %s, TP %d, %s", self.device, self.spec, self.layout.tp, train_config(job))

    def _owned(self) -> list[torch.Tensor]:
        return megatron_owned(self.gpt, self.megatron_optimizer)

    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: the policy after the last update, {HF name: fp32 tensor on this device}; a tied LM head
        once, as `model.embed_tokens.weight`. Other ranks: {} (they took part in the gather in `update`)."""
        return self._hf

    def served_weights(self, full: bool = False) -> dict[str, torch.Tensor]:
        """`weights()`: train.lora is refused with this backend, so a sync sends the whole model."""
        return self.weights()

    def _export(self) -> None:
        """Collective: gather the HF tensors over TP; rank 0 keeps fp32 copies (the live ones move on)."""
        from rlslurm.megatron.convert import export_hf

        out = {}
        for name, tensor in export_hf(self.gpt, self.spec, self.layout):
            if self.topo.is_main:
                out[name] = tensor.detach().to(torch.float32, copy=True)
        self._hf = out

    def _data_parallel_share(self, samples: list) -> list:
        """TP ranks must see the same batch: the union of their shares (the RL loop deals one per rank)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.layout.tp == 1:
            return list(samples)
        shares: list = [None] * self.layout.tp
        dist.all_gather_object(shares, list(samples), group=ps.get_tensor_model_parallel_group())
        return [s for share in shares for s in share]

    def update(self, samples: list[Sample], guard: PhaseGuard, *, step_total: int | None = None) -> dict:
        """Clipped GRPO updates on this rank's share, split as rlslurm/rl/policy.py's Policy.update splits
        them (rlslurm/rl/batches.py: rl.mini_batches optimizer steps of parallel.micro_batch_size forward
        passes, the same objective); `step_total` = 0: no rank has a sample, every rank skips (None: the
        ranks count it here)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        # The last version's fp32 copy goes first (the engines have it): the peak measured below is the
        # trainer's own step, what the plan's trainer peak predicts (plus a sync transport's buffers).
        self._hf = {}
        job, device = self.job, self.device
        local = self._data_parallel_share(samples)
        if step_total is None:
            anyone = torch.tensor([len(samples)], device=device)
            dist.all_reduce(anyone, op=dist.ReduceOp.SUM)
            step_total = int(anyone.item())
        if step_total == 0:  # no rank has a sample: no step anywhere, the weights stay as they are
            self._export()
            return UpdateStats().result()  # the trained step's keys, `trained: false`
        # A TP group trains on the union of its ranks' shares (`_data_parallel_share`): its DP rank's share.
        tp, dp = self.layout.tp, self.topo.world_size // self.layout.tp
        dealt = share_sizes(step_total, self.topo.world_size)
        sizes = [sum(dealt[d * tp:(d + 1) * tp]) for d in range(dp)]
        fused = job.memory.fused_ce
        with self.meter.measure("forward_backward"):
            parts, chunks, behaviour, stats = prepare(
                local, sizes, self.topo.rank // tp, job,
                lambda c: token_logprobs(self.gpt, c.tokens, c.labels, fused=fused), device)
        guard.beat()
        loss = 0.0
        reduce = (lambda t: dist.all_reduce(t, group=ps.get_data_parallel_group())) if dp > 1 else None
        units = divisors(self.objective, parts, dp, reduce=reduce, device=device)  # token_mean: over the DP ranks
        for part, part_chunks, behave, divisor in zip(parts, chunks, behaviour, units):
            if part.total:  # else: no DP rank has a sample in this mini-batch, none steps
                loss += self._step(part_chunks, behave, divisor, stats)
                guard.beat()
        self._export()
        steps = len(stats.grad_norms)
        total = torch.tensor([loss], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=ps.get_data_parallel_group())  # each DP rank's share of the mean
        return stats.result(loss=float(total.item()) / max(steps, 1))

    def _step(self, chunks: list[Packed], behaviour: list[torch.Tensor], divisor: float, stats: UpdateStats) -> float:
        """One optimizer step over `chunks` (the same count on every DP rank) through Megatron's schedule;
        returns this rank's share of the mini-batch's loss (the loss / DP size)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_step = partial(_forward_step, self.objective, divisor, len(chunks), stats, self.job.memory.fused_ce)
        seq = chunks[0].tokens.shape[1]
        with on_device():
            self.ddp.zero_grad_buffer()
            self.megatron_optimizer.zero_grad()
            with self.meter.measure("forward_backward"):
                reduced = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(list(zip(chunks, behaviour))),
                    model=[self.ddp], num_microbatches=len(chunks), seq_length=seq,
                    micro_batch_size=self.job.parallel.micro_batch_size, decoder_seq_length=seq, forward_only=False)
            with self.meter.measure("optimizer"):
                _updated, grad_norm, _ = self.megatron_optimizer.step()
        self.steps += 1
        stats.grad_norms.append(float(grad_norm or 0.0))
        dp = self.topo.world_size // self.layout.tp
        return float(sum(r["loss"] for r in reduced)) / dp if reduced else float("nan")


@dataclass(frozen=True)
class FromForward:
    """A micro-batch's behaviour log-probs in an update of one mini-batch (rlslurm/rl/batches.py
    `behaviour_forward`): the training forward's own, detached, taken in `_loss`; `rows` are its samples, whose
    engine/trainer gap and drift are observed there."""

    rows: list


def prepare(local: list[Sample], sizes: list[int], dp_rank: int, job, logprobs, device):
    """This DP rank's mini-batches (rlslurm/rl/batches.py), each as the micro-batches Megatron's schedule
    runs (as many on every DP rank), with the behaviour log-probs taken once, before the first optimizer
    step, by `logprobs(chunk)` (rl.mini_batches > 1; with one, a FromForward per micro-batch: the training
    forward's own): (parts, chunks, behaviour, stats). Plain torch: runs on CPU too."""
    from rlslurm.tokenizer import PAD_ID

    micro, objective = job.parallel.micro_batch_size, Objective.of(job)
    parts = mini_batches(local, sizes, dp_rank, job.rl.mini_batches)
    forward = behaviour_forward(job.rl.mini_batches)
    stats = UpdateStats()
    chunks, behaviour = [], []
    with torch.no_grad():
        for part, count in zip(parts, micro_batch_counts(sizes, job.rl.mini_batches, micro)):
            chunks.append(split_rows(pack(part.samples, PAD_ID).to(device), micro, count))
            behaviour.append([])
            for rows, chunk in zip(micro_batches(part.samples, micro), chunks[-1]):
                if not forward:
                    behaviour[-1].append(FromForward(rows))
                    continue
                old = logprobs(chunk)
                behaviour[-1].append(behaviour_logprobs(chunk, old))
                stats.observe(rows, chunk, old, behaviour[-1][-1], objective)
            behaviour[-1] += [torch.zeros_like(c.mask) for c in chunks[-1][len(behaviour[-1]):]]
    return parts, chunks, behaviour, stats


def _forward_step(objective: Objective, divisor: float, micro_batches: int, stats: UpdateStats, fused: bool,
                  data_iterator, model):
    """Megatron's forward_step_func: the model's per-token loss of one micro-batch, and the objective on it."""
    chunk, behave = next(data_iterator)
    nll = token_nll(model, chunk.tokens, chunk.labels, fused=fused)
    return nll, partial(_loss, chunk, behave, objective, divisor, micro_batches, stats)


def split_rows(batch: Packed, size: int, count: int) -> list[Packed]:
    """`batch` in `count` micro-batches of at most `size` rows, zero-weight rows standing in for the ones a
    short share lacks (every DP rank runs as many through Megatron's schedule)."""
    chunks = [batch.rows(i, i + size) for i in range(0, batch.samples, size)]
    return chunks + [_zero_rows(batch) for _ in range(count - len(chunks))]


def _zero_rows(like: Packed) -> Packed:
    """One row that weighs nothing: pads a DP rank's micro-batches to its peers' count."""
    return Packed(like.tokens[:1].clone(), like.labels[:1].clone(), torch.zeros_like(like.mask[:1]),
                  torch.zeros_like(like.advantages[:1]), torch.zeros_like(like.engine_logprobs[:1]),
                  torch.zeros_like(like.stale[:1]), like.lengths[:1].clone(), like.samples)


def _loss(chunk: Packed, behaviour: torch.Tensor | FromForward, objective: Objective, divisor: float,
          micro_batches: int,
          stats: UpdateStats, nll: torch.Tensor):
    # Megatron divides a 2-tuple loss by the number of micro-batches; the objective is already this chunk's
    # share of the mini-batch's mean (x DP size, which Megatron's DDP averages away), so that division is undone.
    new = -nll.float()
    if isinstance(behaviour, FromForward):  # one mini-batch: the behaviour policy is this very forward's
        old = new.detach()
        rows, behaviour = behaviour.rows, behaviour_logprobs(chunk, old)
        stats.observe(rows, chunk, old, behaviour, objective)
    loss = objective.loss(new, behaviour, chunk, divisor)
    stats.clip(new, behaviour, chunk, objective)
    return loss * micro_batches, {"loss": loss.detach()}


# -- what rlslurm/rl/checkpointing.py reads as policy.model and policy.optimizer ----------------------------

class HFView:
    """The policy in Hugging Face terms: rlslurm/rl/checkpointing.py's `load` puts a checkpoint's HF tensors in through
    `load_state_dict` (collective: every rank), and `save_hf` exports it through `save_pretrained` (rank 0)."""

    def __init__(self, policy: MegatronPolicy):
        from transformers import AutoConfig, GenerationConfig

        self.policy = policy
        self.config = AutoConfig.from_pretrained(str(policy.model_dir))
        self.generation_config = GenerationConfig.from_model_config(self.config)

    def load_state_dict(self, state, strict: bool = False):
        from rlslurm.megatron.convert import load_hf_into

        p = self.policy
        load_hf_into(p.gpt, state, p.spec, p.layout)
        with on_device():
            p.megatron_optimizer.reload_model_params()  # the fp32 master weights follow the loaded ones
        p._export()

    def save_pretrained(self, directory: str | Path, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(directory))
        self.generation_config.save_pretrained(str(directory))
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.policy.weights().items()}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})

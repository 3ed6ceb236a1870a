"""`train.backend = megatron`: the RL policy on Megatron-core (GPU only), beside rlslurm/rl/policy.py's torch Policy.

    policy = MegatronPolicy(job, topo, model_dir)      # rlslurm/rl/policy.py's make_policy picks it by train.backend
    stats = policy.update(samples, guard)              # rl.mini_batches clipped GRPO steps; peak GPU memory in the stats
    weights = policy.weights()                         # rank 0: {HF name: fp32 tensor}, what the engines serve

The same interface as the torch Policy, so the RL loop does not know which one trains:
  - `update(samples, guard)` makes the same clipped, sequence-mean GRPO objective (rlslurm/rl/objective.py)
    on the same split (rlslurm/rl/batches.py: rl.mini_batches optimizer steps, forwards of
    parallel.micro_batch_size; tests/integration/test_megatron_policy.py holds it to the torch Policy's
    loss) through Megatron's DDP, distributed optimizer and schedule (rlslurm/megatron/trainer.py). Every
    rank takes every optimizer step, also one where its share is empty (a zero-weight row stands in), so
    no rank's weights fall behind.
  - `weights()` are the HF-named tensors of convert.export_hf, gathered over TP by every rank at the end
    of `update` (the RL loop asks rank 0 alone, and export_hf is collective) and kept on rank 0's GPU as
    fp32, the dtype the engines serve (rollout server's --dtype float32) and VERIFY compares.
  - `model` is an HF view (`HFView`): rlslurm/rl/checkpointing.py loads a checkpoint's HF tensors into it (every rank)
    and exports it with `save_hf` (rank 0). `optimizer` checkpoints the step count (rank 0) and, through
    `save_shards` on every rank, its share of Adam's moments and of the fp32 master weights.

The model's shape is read from the checkpoint's config.json (what train.init_from or the random init
wrote), with its RMSNorm epsilon; precision, recompute and the distributed optimizer follow `memory:`,
so the plan's memory prediction describes the trainer that runs (bench/gpu_smoke.py compares them).

What runs where: the CUDA check (`require_cuda`), the config rules (`job_rules`), the split (`prepare`),
the forward step and the objective are plain torch and are tested on CPU; the model's log-probabilities
through `token_logprobs` run on CPU too (Megatron's model has CPU shims). DDP, the optimizer and the
schedule are CUDA-only: `update` has run on no GPU yet (docs/gpu.md).
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import torch

from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import bind_local_gpu
from rlslurm.errors import ConfigError, RlslurmError
from rlslurm.modelspec import ModelConfig
from rlslurm.node import node_name
from rlslurm.rl.batches import micro_batch_counts, micro_batches, mini_batches, share_sizes
from rlslurm.rl.experience import Sample
from rlslurm.rl.objective import Packed, UpdateStats, behaviour_logprobs, grpo_objective, pack
from rlslurm.rl.policy import RLPolicy

log = logging.getLogger(__name__)


# -- checks: at config load (job_rules) and at run time (require_cuda) ----------------------------------

def job_rules(job) -> list[tuple[str, str]]:
    """(key, message) for each setting the Megatron RL policy cannot run; JobConfig raises the first, the
    message following `<key> = <value> ` as the loader prints it."""
    rules = []
    if job.job.kind != "rl":
        rules.append(("train.backend", f"is implemented for job.kind = 'rl' only, not job.kind = "
                                       f"{job.job.kind!r}: set train.backend = torch"))
    if job.rl.kl_coef > 0:
        rules.append(("rl.kl_coef", "> 0 needs a frozen reference model, which train.backend = 'megatron' does "
                                    "not build yet: set rl.kl_coef = 0 or train.backend = torch"))
    for key in ("pp", "cp", "ep"):
        value = getattr(job.parallel, key)
        if value != 1:
            rules.append((f"parallel.{key}", "must be 1 with train.backend = 'megatron': its RL policy splits over "
                                             "TP and data parallel only so far (parallel.pp = cp = ep = 1)"))
    if job.parallel.etp not in (None, job.parallel.tp):
        rules.append(("parallel.etp", "must be null (= parallel.tp) with train.backend = 'megatron': its RL policy "
                                      "trains dense models only so far"))
    if job.memory.weight_bytes not in (2.0, 4.0):
        rules.append(("memory.weight_bytes", "must be 2 (bf16 weights, fp32 master copy) or 4 (fp32) with "
                                             "train.backend = 'megatron'"))
    return rules


def _value(job, key: str):
    section, name = key.split(".")
    return getattr(getattr(job, section), name)


def require_cuda() -> None:
    """Raise RlslurmError naming the fix where this process has no CUDA GPU (train.backend = megatron)."""
    if torch.cuda.is_available():
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    raise RlslurmError(
        f"train.backend = 'megatron' needs a CUDA GPU on every trainer rank; {node_name()} has none "
        f"visible (torch {torch.__version__}, {build}). Set train.backend = torch to train on CPU, or run on GPU "
        "nodes in a venv with the [gpu] extra (pip install -e '.[gpu]'; docs/gpu.md)")


def train_config(job):
    """MegatronTrainConfig from `memory:` (the planner's knobs are the trainer's knobs)."""
    from rlslurm.megatron.trainer import MegatronTrainConfig

    return MegatronTrainConfig(bf16=job.memory.weight_bytes == 2.0, recompute=job.memory.recompute,
                               distributed_optimizer=job.memory.distributed_optimizer)


def hf_model_spec(model_dir: str | Path) -> tuple[ModelConfig, float]:
    """(ModelConfig, RMSNorm epsilon) of the Llama checkpoint in model_dir, read from its config.json."""
    from rlslurm.megatron.convert import ROPE_BASE

    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") != "llama":
        raise ConfigError(f"{path}: model_type {cfg.get('model_type')!r}; the Megatron RL policy trains Llama-layout "
                          "checkpoints (the embedded model, SmolLM2): set train.backend = torch")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", ROPE_BASE))
    if head_dim * heads != hidden or float(rope) != ROPE_BASE or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConfigError(f"{path}: head_dim {head_dim} x heads {heads} != hidden {hidden}, rope_theta {rope} != "
                          f"{ROPE_BASE}, or biases: rlslurm/megatron/convert.py maps none of these yet")
    spec = ModelConfig(name=Path(model_dir).name, layers=cfg["num_hidden_layers"], hidden=hidden, heads=heads,
                       kv_heads=cfg.get("num_key_value_heads") or heads, ffn_hidden=cfg["intermediate_size"],
                       vocab=cfg["vocab_size"], max_positions=cfg["max_position_embeddings"],
                       tie_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    return spec, float(cfg.get("rms_norm_eps", 1e-6))


# -- the model's log-probabilities (the objective itself is rlslurm/rl/objective.py's, shared with torch) --

def token_logprobs(gpt, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[:, t] | tokens[:, :t+1]) from a Megatron GPTModel (PP = 1); collective over its TP group."""
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    # True = masked out (Megatron's convention); right padding needs no more than the causal mask.
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
    return -gpt(tokens, positions, causal, labels=labels).float()


# -- the policy -----------------------------------------------------------------------------------------

class MegatronPolicy(RLPolicy):
    """The trained GPTModel (Megatron DDP + distributed optimizer) on this rank's GPU."""

    def __init__(self, job, topo, model_dir: str | Path):
        from transformers import AutoTokenizer

        from rlslurm.megatron.convert import Layout, SafetensorsDir, load_hf_into
        from rlslurm.megatron.model import init_parallel
        from rlslurm.megatron.trainer import build_trainer

        require_cuda()
        for key, message in job_rules(job):  # JobConfig refused these at load; a hand-built job may not have
            raise ConfigError(f"{key} = {_value(job, key)!r} {message}")
        bind_local_gpu(topo.local_rank)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.job, self.topo, self.model_dir = job, topo, Path(model_dir)
        self.spec, norm_eps = hf_model_spec(model_dir)
        self.layout = Layout(tp=job.parallel.tp)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        init_parallel(self.layout, seed=job.train.seed)
        self.ddp, self.megatron_optimizer = build_trainer(
            self.spec, self.layout, train_config(job), lr=job.train.lr, grad_clip=job.train.grad_clip,
            weight_decay=job.train.weight_decay, layernorm_epsilon=norm_eps,
            init=lambda gpt: load_hf_into(gpt, SafetensorsDir(model_dir), self.spec, self.layout))
        self.gpt = self.ddp.module
        self.steps = 0
        self._hf: dict[str, torch.Tensor] = {}
        self._export()
        self.model = HFView(self)
        self.optimizer = OptimizerState(self)
        log.info("megatron policy: %s, TP %d, %s, peak %.3f GB after build", self.spec, self.layout.tp,
                 train_config(job), torch.cuda.max_memory_allocated() / 1e9)

    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: the policy after the last update, {HF name: fp32 tensor on this GPU}; a tied LM head
        once, as `model.embed_tokens.weight`. Other ranks: {} (they took part in the gather in `update`)."""
        return self._hf

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
        torch.cuda.reset_peak_memory_stats()
        job, device = self.job, torch.cuda.current_device()
        local = self._data_parallel_share(samples)
        if step_total is None:
            anyone = torch.tensor([len(samples)], device=device)
            dist.all_reduce(anyone, op=dist.ReduceOp.SUM)
            step_total = int(anyone.item())
        if step_total == 0:  # no rank has a sample: no step anywhere, the weights stay as they are
            memory = _memory_stats()
            self._export()
            return {"loss": 0.0, "tokens": 0, "kl": 0.0, "grad_norm": 0.0, "mini_batches": 0, **memory}
        # A TP group trains on the union of its ranks' shares (`_data_parallel_share`): its DP rank's share.
        tp, dp = self.layout.tp, self.topo.world_size // self.layout.tp
        dealt = share_sizes(step_total, self.topo.world_size)
        sizes = [sum(dealt[d * tp:(d + 1) * tp]) for d in range(dp)]
        parts, chunks, behaviour, stats = prepare(
            local, sizes, self.topo.rank // tp, job, lambda c: token_logprobs(self.gpt, c.tokens, c.labels), device)
        guard.beat()
        loss = 0.0
        for part, part_chunks, behave in zip(parts, chunks, behaviour):
            if part.total:  # else: no DP rank has a sample in this mini-batch, none steps
                loss += self._step(part_chunks, behave, part.total / dp, stats)
                guard.beat()
        memory = _memory_stats()  # before the export adds the fp32 copy for the engines
        self._export()
        steps = len(stats.grad_norms)
        total = torch.tensor([loss], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=ps.get_data_parallel_group())  # each DP rank's share of the mean
        return {"loss": float(total.item()) / max(steps, 1), "kl": 0.0, "mini_batches": steps, **stats.result(),
                **memory}

    def _step(self, chunks: list[Packed], behaviour: list[torch.Tensor], divisor: float, stats: UpdateStats) -> float:
        """One optimizer step over `chunks` (the same count on every DP rank) through Megatron's schedule;
        returns this rank's share of the mini-batch's loss (the loss / DP size)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_step = partial(_forward_step, self.job.rl.clip_eps, divisor, len(chunks), stats)
        self.ddp.zero_grad_buffer()
        self.megatron_optimizer.zero_grad()
        seq = chunks[0].tokens.shape[1]
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(list(zip(chunks, behaviour))), model=[self.ddp],
            num_microbatches=len(chunks), seq_length=seq, micro_batch_size=self.job.parallel.micro_batch_size,
            decoder_seq_length=seq, forward_only=False)
        _updated, grad_norm, _ = self.megatron_optimizer.step()
        self.steps += 1
        stats.grad_norms.append(float(grad_norm or 0.0))
        dp = self.topo.world_size // self.layout.tp
        return float(sum(r["loss"] for r in reduced)) / dp if reduced else float("nan")


def prepare(local: list[Sample], sizes: list[int], dp_rank: int, job, logprobs, device):
    """This DP rank's mini-batches (rlslurm/rl/batches.py), each as the micro-batches Megatron's schedule
    runs (as many on every DP rank), with the behaviour log-probs taken once, before the first optimizer
    step, by `logprobs(chunk)`: (parts, chunks, behaviour, stats). Plain torch: runs on CPU too."""
    from rlslurm.tokenizer import PAD_ID

    micro = job.parallel.micro_batch_size
    parts = mini_batches(local, sizes, dp_rank, job.rl.mini_batches)
    stats = UpdateStats()
    chunks, behaviour = [], []
    with torch.no_grad():
        for part, count in zip(parts, micro_batch_counts(sizes, job.rl.mini_batches, micro)):
            chunks.append(split_rows(pack(part.samples, PAD_ID).to(device), micro, count))
            behaviour.append([])
            for rows, chunk in zip(micro_batches(part.samples, micro), chunks[-1]):
                old = logprobs(chunk)
                behaviour[-1].append(behaviour_logprobs(chunk, old))
                stats.observe(rows, chunk, old, behaviour[-1][-1])
            behaviour[-1] += [torch.zeros_like(c.mask) for c in chunks[-1][len(behaviour[-1]):]]
    return parts, chunks, behaviour, stats


def _forward_step(clip: float, divisor: float, micro_batches: int, stats: UpdateStats, data_iterator, model):
    """Megatron's forward_step_func: the model's per-token loss of one micro-batch, and the objective on it."""
    chunk, behave = next(data_iterator)
    seq = chunk.tokens.shape[1]
    positions = torch.arange(seq, device=chunk.tokens.device).unsqueeze(0).expand_as(chunk.tokens)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=chunk.tokens.device), diagonal=1)
    nll = model(chunk.tokens, positions, causal[None, None], labels=chunk.labels)
    return nll, partial(_loss, chunk, behave, clip, divisor, micro_batches, stats)


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


def _loss(chunk: Packed, behaviour: torch.Tensor, clip: float, divisor: float, micro_batches: int,
          stats: UpdateStats, nll: torch.Tensor):
    # Megatron divides a 2-tuple loss by the number of micro-batches; the objective is already this chunk's
    # share of the mini-batch's mean (x DP size, which Megatron's DDP averages away), so that division is undone.
    new = -nll.float()
    loss = grpo_objective(new, behaviour, chunk, clip, divisor)
    stats.clip(new, behaviour, chunk, clip)
    return loss * micro_batches, {"loss": loss.detach()}


def _memory_stats() -> dict:
    """This rank's GPU memory peak since the step began, in GB: Megatron's weights, grads, optimizer and
    activations, plus whatever else this process holds on the GPU (a sync transport's buffers on rank 0)."""
    return {"train_peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
            "train_peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}


# -- what rlslurm/rl/checkpointing.py reads as policy.model and policy.optimizer -------------------------------------------

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


class OptimizerState:
    """What rlslurm/rl/checkpointing.py checkpoints as the optimizer: the step count in `optimizer.pt` (rank 0), and each
    rank's share of Adam in its own `optimizer-rank<NNNNN>.pt` (`save_shards`, `load_shards`).

    Each of Megatron's optimizers wraps a torch optimizer (`.optimizer`) whose parameters are the fp32
    master weights this rank updates (with the distributed optimizer, its DP slice of them) and whose
    state holds Adam's moments of exactly those. A rank saves that torch optimizer's state dict and the
    master weights, untouched and without any gather, and loads them back into the same places. Without
    them a resumed run would restart Adam at zero moments and, with bf16 weights, lose the master
    weights' low bits. The shards are cut by the layout: a resume must keep world size and parallel.tp."""

    def __init__(self, policy):
        self.policy = policy
        self._saved: dict = {}

    def _layout(self) -> dict:
        return {"world_size": self.policy.topo.world_size, "tp": self.policy.layout.tp,
                "distributed_optimizer": self.policy.job.memory.distributed_optimizer}

    def _inner(self) -> list:
        """The torch optimizers inside Megatron's (one per chained part)."""
        opt = self.policy.megatron_optimizer
        return [part.optimizer for part in getattr(opt, "chained_optimizers", [opt])]

    def _shard_name(self, rank: int) -> str:
        return f"optimizer-rank{rank:05d}"

    def state_dict(self) -> dict:
        return {"backend": "megatron", "steps": self.policy.steps, "layout": self._layout(),
                "shards": self.policy.topo.world_size if self.policy.steps else 0}

    def load_state_dict(self, state: dict) -> None:
        self.policy.steps = int(state.get("steps", 0))
        self._saved = state

    def save_shards(self, directory: Path) -> list[str]:
        """This rank's Adam state and master weights into `directory` (every rank; nothing collective)."""
        from rlslurm.checkpoint import write_rank_state

        if self.policy.steps == 0:  # no step taken: nothing but zeros to save
            return []
        parts = [{"state_dict": inner.state_dict(),
                  "master": [p.detach().cpu().clone() for group in inner.param_groups for p in group["params"]]}
                 for inner in self._inner()]
        shard = {"layout": self._layout(), "steps": self.policy.steps, "parts": parts}
        return [write_rank_state(directory, self._shard_name(self.policy.topo.rank), shard)]

    def load_shards(self, ckpt) -> None:
        """After `load_state_dict` and the model's weights: this rank's Adam state and master weights back."""
        if not self._saved.get("shards"):
            if self.policy.steps:
                log.warning("train.backend = megatron: checkpoint %s holds no optimizer shards; Adam's moments "
                            "restart at step %d", ckpt.name, self.policy.steps)
            return
        if self._saved.get("layout") != self._layout():
            raise RlslurmError(
                f"checkpoint {ckpt.path} was written with {self._saved.get('layout')}, this run is "
                f"{self._layout()}: Megatron's optimizer shards are cut by that layout. Resume with the same "
                "world size and parallel.tp, or start a new run from its weights (train.init_from = its export)")
        shard = ckpt.load_state(self._shard_name(self.policy.topo.rank))
        inners = self._inner()
        if len(shard["parts"]) != len(inners):
            raise RlslurmError(f"checkpoint {ckpt.path}: {len(shard['parts'])} optimizer parts saved, this run "
                               f"builds {len(inners)}: the model or its parallel layout changed")
        for inner, part in zip(inners, shard["parts"]):
            inner.load_state_dict(part["state_dict"])
            params = [p for group in inner.param_groups for p in group["params"]]
            if [p.shape for p in params] != [m.shape for m in part["master"]]:
                raise RlslurmError(f"checkpoint {ckpt.path}: the saved master weights' shapes differ from this "
                                   "run's: the model or its parallel layout changed")
            with torch.no_grad():
                for p, master in zip(params, part["master"]):
                    p.copy_(master)
        # The model's own weights came from the checkpoint's HF tensors (HFView.load_state_dict): the cast
        # of these master weights taken after the last step, so the two agree without a copy.
        log.info("megatron policy: Adam's moments and master weights restored from %s (step %d)",
                 ckpt.name, self.policy.steps)

"""Parallel layout of the trainer and the divisibility rules it must satisfy.

`parallel:` in a job YAML. Megatron-core's two rank grids (megatron/core/parallel_state.py's
initialize_model_parallel): the dense layers' world = TP x CP x DP x PP, the expert layers' world =
ETP x EP x expert-DP x PP over the same ranks. So DP = world / (TP x CP x PP) and the expert-DP group
that shards the expert optimizer is world / (ETP x EP x PP): with CP = 1 and ETP = TP that is DP / EP
(the lecture's rule EP | DP), with CP > 1 the context-parallel ranks join the expert-DP group.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.configfile import check_range


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: ranks that split every matrix (stays inside a node). Range [1, 64]."""
    pp: int = 1
    """Pipeline-parallel size: stages that split the layers. Range [1, 1024]."""
    cp: int = 1
    """Context-parallel size: ranks that split the sequence. Range [1, 1024]."""
    ep: int = 1
    """Expert-parallel size: ranks that split the routed experts (ETP x EP x PP must divide the training GPUs;
    with CP = 1 and ETP = TP: EP divides DP). Range [1, 4096]."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on one rank: one forward + backward of either RL trainer (torch and Megatron),
    gradients accumulated up to the mini-batch's optimizer step (rl.mini_batches); the plan's activation
    memory is that of this many sequences. Range [1, 65536]."""
    seq_len: int = 64
    """Training sequence length in tokens. Range [1, 1e8]."""
    etp: int | None = None
    """Expert tensor-parallel size: ranks that split each expert's matrices; null = parallel.tp (Megatron's
    default). Range [1, 64]."""

    def __post_init__(self):
        check_range(self.tp, "tp", 1, 64)
        for name in ("pp", "cp"):
            check_range(getattr(self, name), name, 1, 1024)
        check_range(self.ep, "ep", 1, 4096)
        check_range(self.micro_batch_size, "micro_batch_size", 1, 65_536)
        check_range(self.seq_len, "seq_len", 1, 10**8, note="tokens")
        check_range(self.etp, "etp", 1, 64, note="null: parallel.tp")

    @property
    def expert_tp(self) -> int:
        """ETP as Megatron resolves it: parallel.etp, or TP when unset."""
        return self.etp or self.tp


@dataclass(frozen=True)
class Rule:
    """One divisibility rule broken by a layout: the config keys involved and the numbers."""

    keys: tuple[str, ...]
    message: str


def data_parallel(parallel: ParallelConfig, world: int) -> int:
    """DP = world / (TP x PP x CP); 0 when the product does not divide the world."""
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    return world // model_parallel if world % model_parallel == 0 else 0


def expert_data_parallel(parallel: ParallelConfig, world: int) -> int:
    """Expert-DP = world / (ETP x EP x PP), Megatron-core's expert rank grid; 0 when it does not divide."""
    expert_model_parallel = parallel.expert_tp * parallel.ep * parallel.pp
    return world // expert_model_parallel if world % expert_model_parallel == 0 else 0


def static_rules(parallel: ParallelConfig, layers: int, heads: int, kv_heads: int, experts: int,
                 gpus_per_node: int, rollout_tp: int | None = None) -> list[Rule]:
    """Every rule that holds or breaks whatever the number of training GPUs (rollout_tp: the engines' TP);
    all broken ones, not the first: a user fixes a layout once, not once per rule."""
    p = parallel
    broken: list[Rule] = []
    if p.cp > 1 and p.seq_len % (2 * p.cp):
        # Megatron's CP cuts the sequence into 2 x CP chunks so every rank gets equal causal work.
        broken.append(Rule(("parallel.cp", "parallel.seq_len"),
                           f"2 x parallel.cp = {2 * p.cp} does not divide parallel.seq_len = {p.seq_len} "
                           "(context parallelism splits the sequence into 2 x CP chunks)"))
    if p.tp > 1 and p.seq_len % p.cp == 0 and (p.seq_len // p.cp) % p.tp:
        broken.append(Rule(("parallel.tp", "parallel.seq_len"),
                           f"parallel.tp = {p.tp} does not divide the per-CP sequence "
                           f"{p.seq_len // p.cp} tokens (sequence parallelism splits it over TP)"))
    if rollout_tp is not None and heads % rollout_tp:
        broken.append(Rule(("rollout.tp", "model.heads"),
                           f"rollout.tp = {rollout_tp} does not divide model.heads = {heads} "
                           "(an engine splits attention heads over its GPUs)"))
    for key, size in (("parallel.tp", p.tp), ("parallel.etp", p.etp if experts else None)):
        if size is not None and (size > gpus_per_node or gpus_per_node % size):
            broken.append(Rule((key, "hardware.gpus_per_node"),
                               f"{key} = {size} must divide hardware.gpus_per_node = {gpus_per_node} "
                               "(tensor parallelism stays inside a node's fast links)"))
    if heads % p.tp:
        broken.append(Rule(("parallel.tp", "model.heads"),
                           f"parallel.tp = {p.tp} does not divide model.heads = {heads}"))
    if kv_heads % p.tp and p.tp % kv_heads:
        broken.append(Rule(("parallel.tp", "model.kv_heads"),
                           f"parallel.tp = {p.tp} and model.kv_heads = {kv_heads}: one must divide the other"))
    if layers % p.pp:
        broken.append(Rule(("parallel.pp", "model.layers"),
                           f"parallel.pp = {p.pp} does not divide model.layers = {layers}"))
    if p.ep > 1 and experts and experts % p.ep:
        broken.append(Rule(("parallel.ep", "model.experts"),
                           f"parallel.ep = {p.ep} does not divide model.experts = {experts}"))
    for key, size in (("parallel.ep", p.ep), ("parallel.etp", p.etp)):
        if size is not None and size > 1 and not experts:
            broken.append(Rule((key, "model.experts"), f"{key} = {size} needs an MoE model (model.experts = 0)"))
    return broken


def rollout_rules(rollout_gpus: int, rollout_tp: int) -> list[Rule]:
    """Rules between the rollout GPUs of a split and the engines' TP size."""
    if rollout_gpus and rollout_gpus % rollout_tp:
        return [Rule(("rollout.tp",), f"rollout.tp = {rollout_tp} does not divide the {rollout_gpus} rollout GPUs "
                                      "(every engine needs whole TP groups)")]
    return []


def world_rules(parallel: ParallelConfig, world: int) -> list[Rule]:
    """Every rule between the layout and a number of training GPUs (world) that it breaks: Megatron-core's
    two grids, dense (TP x CP x PP must divide the world) and expert (ETP x EP x PP must)."""
    p = parallel
    broken: list[Rule] = []
    mp = p.tp * p.pp * p.cp
    if world % mp:
        broken.append(Rule(("parallel.tp", "parallel.pp", "parallel.cp"),
                           f"TP x PP x CP = {p.tp} x {p.pp} x {p.cp} = {mp} does not divide {world} training GPUs"))
    emp = p.expert_tp * p.ep * p.pp
    if world % emp == 0 or (p.ep == 1 and p.expert_tp == p.tp):  # no experts split: the dense grid's rule
        return broken
    if p.cp == 1 and p.expert_tp == p.tp and not world % mp:
        # The same rule in the lecture's words: with CP = 1 and ETP = TP, expert-DP = DP / EP.
        broken.append(Rule(("parallel.ep",), f"parallel.ep = {p.ep} does not divide DP = {world // mp} "
                                             f"({world} training GPUs / TP x PP x CP = {mp})"))
    else:
        broken.append(Rule(("parallel.ep", "parallel.etp", "parallel.pp"),
                           f"parallel.ep = {p.ep}: ETP x EP x PP = {p.expert_tp} x {p.ep} x {p.pp} = {emp} does not "
                           f"divide {world} training GPUs (Megatron's expert layers: expert-DP = world / "
                           "(ETP x EP x PP))"))
    return broken


def trainer_rules(backend: str, p: ParallelConfig, experts: int) -> list[tuple[str, str]]:
    """(key, message) for each split `backend`'s trainer in rlslurm's runtime does not do yet: the torch trainer
    is data-parallel (DDP) over a dense model, Megatron's splits over TP and DP. The plan computes such a
    layout anyway (the arithmetic is for the cluster you will run); `rlslurm submit` refuses it, naming why."""
    out = []
    if backend == "torch":
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(p, key) != 1:
                out.append((f"parallel.{key}", f"= {getattr(p, key)} needs train.backend = megatron: the torch trainer "
                                               "is data-parallel only (DDP)"))
        if experts:
            out.append(("model.experts", f"= {experts}: the torch trainer's model is dense; MoE is not run by "
                                         "rlslurm's trainers yet (plan only)"))
        return out
    for key in ("pp", "cp", "ep"):
        if getattr(p, key) != 1:
            out.append((f"parallel.{key}", f"= {getattr(p, key)} must be 1 with train.backend = 'megatron': its "
                                           "trainer splits over TP and data parallel only so far"))
    if p.etp not in (None, p.tp):
        out.append(("parallel.etp", f"= {p.etp} must be null (= parallel.tp) with train.backend = 'megatron': its "
                                    "trainer trains dense models only so far"))
    if experts:
        out.append(("model.experts", f"= {experts}: rlslurm's Megatron trainer trains dense models only so far "
                                     "(plan only)"))
    return out


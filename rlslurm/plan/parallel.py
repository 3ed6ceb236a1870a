"""Parallel layout of the trainer and the divisibility rules it must satisfy.

`parallel:` in a job YAML. world = TP x PP x CP x DP; EP divides DP (experts shard over data-parallel
ranks); the expert-DP group that shards the expert optimizer is DP / EP.
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
    """Expert-parallel size: ranks that split the routed experts (must divide DP). Range [1, 4096]."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on one rank. Range [1, 65536]."""
    seq_len: int = 64
    """Training sequence length in tokens. Range [1, 1e8]."""

    def __post_init__(self):
        check_range(self.tp, "tp", 1, 64)
        for name in ("pp", "cp"):
            check_range(getattr(self, name), name, 1, 1024)
        check_range(self.ep, "ep", 1, 4096)
        check_range(self.micro_batch_size, "micro_batch_size", 1, 65_536)
        check_range(self.seq_len, "seq_len", 1, 10**8, note="tokens")


@dataclass(frozen=True)
class Rule:
    """One divisibility rule broken by a layout: the config keys involved and the numbers."""

    keys: tuple[str, ...]
    message: str


def data_parallel(parallel: ParallelConfig, world: int) -> int:
    """DP = world / (TP x PP x CP); 0 when the product does not divide the world."""
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    return world // model_parallel if world % model_parallel == 0 else 0


def static_rules(parallel: ParallelConfig, layers: int, heads: int, kv_heads: int, experts: int,
                 gpus_per_node: int, rollout_tp: int | None = None) -> list[Rule]:
    """Rules that hold or break whatever the number of training GPUs (rollout_tp: the engines' TP)."""
    p = parallel
    broken: list[Rule] = []
    if p.cp > 1 and p.seq_len % (2 * p.cp):
        # Megatron's CP cuts the sequence into 2 x CP chunks so every rank gets equal causal work.
        broken.append(Rule(("parallel.cp", "parallel.seq_len"),
                           f"2 x parallel.cp = {2 * p.cp} does not divide parallel.seq_len = {p.seq_len} "
                           "(context parallelism splits the sequence into 2 x CP chunks)"))
    elif p.tp > 1 and (p.seq_len // p.cp) % p.tp:
        broken.append(Rule(("parallel.tp", "parallel.seq_len"),
                           f"parallel.tp = {p.tp} does not divide the per-CP sequence "
                           f"{p.seq_len // p.cp} tokens (sequence parallelism splits it over TP)"))
    if rollout_tp is not None and heads % rollout_tp:
        broken.append(Rule(("rollout.tp", "model.heads"),
                           f"rollout.tp = {rollout_tp} does not divide model.heads = {heads} "
                           "(an engine splits attention heads over its GPUs)"))
    if p.tp > gpus_per_node or gpus_per_node % p.tp:
        broken.append(Rule(("parallel.tp", "hardware.gpus_per_node"),
                           f"parallel.tp = {p.tp} must divide hardware.gpus_per_node = {gpus_per_node} "
                           "(tensor parallelism stays inside a node's fast links)"))
    if heads % p.tp:
        broken.append(Rule(("parallel.tp", "model.heads"), f"parallel.tp = {p.tp} does not divide model.heads = {heads}"))
    elif kv_heads % p.tp and p.tp % kv_heads:
        broken.append(Rule(("parallel.tp", "model.kv_heads"),
                           f"parallel.tp = {p.tp} and model.kv_heads = {kv_heads}: one must divide the other"))
    if layers % p.pp:
        broken.append(Rule(("parallel.pp", "model.layers"), f"parallel.pp = {p.pp} does not divide model.layers = {layers}"))
    if p.ep > 1 and experts and experts % p.ep:
        broken.append(Rule(("parallel.ep", "model.experts"), f"parallel.ep = {p.ep} does not divide model.experts = {experts}"))
    if p.ep > 1 and not experts:
        broken.append(Rule(("parallel.ep", "model.experts"), f"parallel.ep = {p.ep} needs an MoE model (model.experts = 0)"))
    return broken


def rollout_rules(rollout_gpus: int, rollout_tp: int) -> list[Rule]:
    """Rules between the rollout GPUs of a split and the engines' TP size."""
    if rollout_gpus and rollout_gpus % rollout_tp:
        return [Rule(("rollout.tp",), f"rollout.tp = {rollout_tp} does not divide the {rollout_gpus} rollout GPUs "
                                      "(every engine needs whole TP groups)")]
    return []


def world_rules(parallel: ParallelConfig, world: int) -> list[Rule]:
    """Rules between the layout and a number of training GPUs (world)."""
    p = parallel
    mp = p.tp * p.pp * p.cp
    if world % mp:
        return [Rule(("parallel.tp", "parallel.pp", "parallel.cp"),
                     f"TP x PP x CP = {p.tp} x {p.pp} x {p.cp} = {mp} does not divide {world} training GPUs")]
    dp = world // mp
    if dp % p.ep:
        return [Rule(("parallel.ep",), f"parallel.ep = {p.ep} does not divide DP = {dp} "
                                       f"({world} training GPUs / TP x PP x CP = {mp})")]
    return []

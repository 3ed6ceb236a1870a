"""The RL job's checkpoints: trainer state and RL state, written at a step boundary by every rank.

    seconds = save(run, job, topo, policy, step, version, rl_state)   # collective
    step, version, rl_state, proceed = resume_point(job, run, topo, policy)

A checkpoint holds the model (HF names, safetensors), the optimizer (a sharded one as one file per
rank, each in the manifest), every rank's RNG and the RL state (step, policy version, the data position
as epoch and index (rlslurm/rl/draw.py), eval history, experience made ahead). rlslurm/checkpoint.py makes
it atomic: temp dir, fsync, manifest with sizes and checksums, rename; resume takes the newest complete
one (rlslurm/lifecycle.py).
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import torch
import torch.distributed as dist

from rlslurm import lifecycle
from rlslurm.checkpoint import Checkpoint, CheckpointWriter
from rlslurm.config import JobConfig
from rlslurm.dist import Topology
from rlslurm.rl.policy import RLPolicy
from rlslurm.rundir import RunDir


def save(run: RunDir, job: JobConfig, topo: Topology, policy: RLPolicy, step: int, version: int,
         rl_state: dict) -> float:
    """Collective: every rank's RNG is gathered; rank 0 writes model, optimizer, RNG and RL state. An
    optimizer sharded over ranks (Megatron's) has its owners write their shards into rank 0's temp dir
    first, so the checkpoint is complete only with every shard in its manifest."""
    rngs = [None] * topo.world_size
    dist.all_gather_object(rngs, {"torch": torch.get_rng_state(), "python": random.getstate()})
    seconds = [0.0]
    with contextlib.ExitStack() as stack:
        ckpt = None
        if topo.is_main:
            ckpt = stack.enter_context(CheckpointWriter(run, step, policy_version=version, keep=job.checkpoint.keep,
                                                        metadata={"job": "rl", "world_size": topo.world_size}))
        for filename in write_shards(policy.optimizer, ckpt, topo):
            ckpt.add_written(filename)
        if ckpt is not None:
            ckpt.save_tensors("model", {k: v.contiguous() for k, v in policy.weights().items()})
            ckpt.save_state("optimizer", policy.optimizer.state_dict())
            ckpt.save_state("rng", rngs)
            # rl_state["data"]: the data position (epoch, index) the controller set for this step
            ckpt.save_json("rl_state", {**rl_state, "step": step, "policy_version": version})
    if ckpt is not None:
        seconds = [ckpt.saved.seconds]
    dist.broadcast_object_list(seconds, src=0)
    return seconds[0]


def write_shards(optimizer, ckpt: CheckpointWriter | None, topo: Topology) -> list[str]:
    """Collective where the optimizer is sharded (it has `save_shards`: Megatron's, in the RL policy and in
    the SFT job): rank 0 (holding `ckpt`) names its temp dir, each rank writes its shard there; rank 0 gets
    every file name, the others []. The torch Policy's optimizer is whole on rank 0: nothing to do."""
    save_shards = getattr(optimizer, "save_shards", None)
    if save_shards is None:
        return []
    where = [str(ckpt.tmp) if ckpt is not None else None]
    dist.broadcast_object_list(where, src=0)
    written = [None] * topo.world_size
    dist.all_gather_object(written, save_shards(Path(where[0])))
    return sorted(name for names in written for name in names) if ckpt is not None else []


def load(ckpt: Checkpoint, policy: RLPolicy, topo: Topology) -> dict:
    """Weights, optimizer (a sharded one then takes this rank's shard: `load_shards`), RNG; the RL state."""
    state = ckpt.load_tensors("model")
    policy.model.load_state_dict(state, strict=False)
    policy.optimizer.load_state_dict(ckpt.load_state("optimizer"))
    load_shards = getattr(policy.optimizer, "load_shards", None)
    if load_shards is not None:
        load_shards(ckpt)
    rng = ckpt.load_state("rng")[topo.rank]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return ckpt.load_json("rl_state")



def resume_point(job: JobConfig, run: RunDir, topo: Topology, policy: RLPolicy) -> tuple[int, int, dict, bool]:
    """(step, policy version, RL state, proceed) of this start: the newest complete checkpoint loaded into
    `policy` (rank 0 picks and verifies it, every rank loads it), or step 0; proceed is False once
    checkpoint.max_no_progress_restarts starts in a row made no progress."""
    path, proceed = lifecycle.agree_on_start(run, is_main=topo.is_main,
                                             max_no_progress_restarts=job.checkpoint.max_no_progress_restarts)
    if not proceed:
        return 0, 0, {}, False
    if path is None:
        return 0, 0, {}, True
    state = load(Checkpoint.open(Path(path), verify=False), policy, topo)  # rank 0 verified it
    return int(state["step"]), int(state["policy_version"]), state, True

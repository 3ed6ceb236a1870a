"""The RL job's checkpoints: trainer state and RL state, written at a step boundary by every rank.

    seconds = save(run, job, topo, policy, step, version, rl_state)   # collective; None: every try failed
    step, version, rl_state, proceed = resume_point(job, run, topo, policy)

A checkpoint holds the model (HF names, safetensors), the optimizer (a sharded one as one file per
rank, each in the manifest), every rank's RNG and the RL state (step, policy version, the data position
as epoch and index (rlslurm/rl/draw.py), eval history, experience made ahead). rlslurm/checkpoint.py makes
it atomic: temp dir, fsync, manifest with sizes and checksums, rename; resume takes the newest complete
one (rlslurm/lifecycle.py).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlslurm import lifecycle
from rlslurm.checkpoint import Checkpoint, CheckpointWriter
from rlslurm.config import JobConfig
from rlslurm.dist import Topology
from rlslurm.errors import CheckpointError
from rlslurm.rl.policy import RLPolicy
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)


def save(run: RunDir, job: JobConfig, topo: Topology, policy: RLPolicy, step: int, version: int,
         rl_state: dict, *, sleep=time.sleep) -> float | None:
    """Collective: every rank's RNG is gathered; rank 0 writes model, optimizer, RNG and RL state. An
    optimizer sharded over ranks (Megatron's) has its owners write their shards into rank 0's temp dir
    first, so the checkpoint is complete only with every shard in its manifest.

    A storage fault is survived here: a failed try (each a `checkpoint_failed` event, rlslurm/checkpoint.py)
    is tried again after checkpoint.retry_backoff_s (doubled each time), up to checkpoint.save_attempts tries.
    Returns the cost in seconds of the try that wrote it, or None on every rank when every try failed (the
    caller trains on; `CheckpointSaves` counts such saves). Every rank learns the same outcome of each try
    from rank 0, so no rank waits in a collective for a rank that gave up."""
    return save_tries(run, job, topo, policy, step, version, rl_state, sleep=sleep)[0]


def save_tries(run: RunDir, job: JobConfig, topo: Topology, policy: RLPolicy, step: int, version: int,
               rl_state: dict, *, sleep=time.sleep) -> tuple[float | None, str | None]:
    """`save`, and the last try's error as rank 0 met it (None once a try wrote it), the same on every rank."""
    rngs = [None] * topo.world_size
    dist.all_gather_object(rngs, {"torch": torch.get_rng_state(), "python": random.getstate()})
    delays = job.checkpoint.retry_delays_s()
    error = None
    for attempt in range(1, len(delays) + 2):
        seconds, error = _attempt(run, job, topo, policy, step, version, rl_state, rngs,
                                  (attempt, len(delays) + 1))
        if error is None:
            return seconds, None
        if attempt <= len(delays):
            log.warning("checkpoint of step %d, try %d of %d failed (%s): trying again in %.1f s", step, attempt,
                        len(delays) + 1, error, delays[attempt - 1])
            sleep(delays[attempt - 1])
    return None, error


def _attempt(run: RunDir, job: JobConfig, topo: Topology, policy: RLPolicy, step: int, version: int,
             rl_state: dict, rngs: list, attempt: tuple[int, int]) -> tuple[float | None, str | None]:
    """Collective: one try of the checkpoint; every rank gets (seconds, None) or (None, rank 0's error)."""
    outcome: list = [None, None]
    writer = None
    if topo.is_main:
        try:
            writer = CheckpointWriter(run, step, policy_version=version, keep=job.checkpoint.keep,
                                      metadata={"job": "rl", "world_size": topo.world_size}, attempt=attempt)
        except CheckpointError as e:  # reported by the writer (checkpoint_failed): its temp dir could not be made
            outcome[1] = str(e)
    if writer is None:
        write_shards(policy.optimizer, None, topo)  # collective: the other ranks' part, or nothing to write into
    else:
        try:
            with writer as ckpt:
                for filename in write_shards(policy.optimizer, ckpt, topo):
                    ckpt.add_written(filename)
                ckpt.save_tensors("model", {k: v.contiguous() for k, v in policy.weights().items()})
                ckpt.save_state("optimizer", policy.optimizer.state_dict())
                ckpt.save_state("rng", rngs)
                # rl_state["data"]: the data position (epoch, index) the controller set for this step
                ckpt.save_json("rl_state", {**plain_state(rl_state), "step": step, "policy_version": version})
            outcome[0] = writer.saved.seconds
        except Exception as e:  # noqa: BLE001 - any failed write of a save (OSError, torch's RuntimeError) was
            # reported by the writer and its temp dir removed; the try is over, the job goes on
            outcome[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0], outcome[1]


class CheckpointSaves:
    """The loop's saves: each through `save_tries`; counts the saves skipped in a row (every try failed) and says
    when to stop: past checkpoint.max_failed_saves the job stops, naming the error (a requeue would only resume
    from the same checkpoint on the same storage again). Rank 0 emits `checkpoint_save_skipped`; every rank
    decides alike (the outcome of every try is rank 0's, broadcast)."""

    def __init__(self, run: RunDir, job: JobConfig, topo: Topology, *, sleep=time.sleep):
        self.run, self.job, self.topo, self.sleep = run, job, topo, sleep
        self.failed_in_a_row = 0

    def save(self, policy: RLPolicy, step: int, version: int, rl_state: dict) -> float | None:
        """Collective: the checkpoint of `step`; its cost in seconds, or None when it was skipped (training goes
        on). Raises CheckpointError on every rank once more than checkpoint.max_failed_saves were skipped in a row."""
        seconds, error = save_tries(self.run, self.job, self.topo, policy, step, version, rl_state, sleep=self.sleep)
        if error is None:
            self.failed_in_a_row = 0
            return seconds
        self.skipped(step, error)
        return None

    def skipped(self, step: int, error: str) -> None:
        """Every try of the save at `step` failed with `error` (the last): say so; raise past the bound."""
        from rlslurm import events
        from rlslurm.checkpoint import LATEST

        self.failed_in_a_row += 1
        cfg = self.job.checkpoint
        stopping = self.failed_in_a_row > cfg.max_failed_saves
        latest = self.run.checkpoints / LATEST
        try:
            newest = latest.read_text().strip() if latest.is_file() else None
        except OSError:
            newest = None
        if self.topo.is_main:
            try:
                events.emit(self.run, events.CHECKPOINT_SAVE_SKIPPED, step=step, attempts=cfg.save_attempts,
                            failed_saves=self.failed_in_a_row, max_failed_saves=cfg.max_failed_saves, error=error,
                            stopping=stopping, newest_complete=newest)
            except OSError as e:  # the storage that failed the save may hold the events too
                log.warning("could not write checkpoint_save_skipped: %s", e)
        if stopping:
            raise CheckpointError(
                f"checkpoint of step {step} failed: {self.failed_in_a_row} saves in a row failed all of their "
                f"{cfg.save_attempts} tries (checkpoint.max_failed_saves = {cfg.max_failed_saves}); the job stops "
                f"rather than train on with nothing to resume from. Last error: {error}; newest complete "
                f"checkpoint: {newest or 'none'}. Fix the storage of {self.run.checkpoints}, then "
                f"`rlslurm resume {self.run.path}`")
        log.warning("checkpoint of step %d skipped after %d tries (%d in a row, checkpoint.max_failed_saves = %d): "
                    "training goes on", step, cfg.save_attempts, self.failed_in_a_row, cfg.max_failed_saves)


def write_shards(optimizer, ckpt: CheckpointWriter | None, topo: Topology) -> list[str]:
    """Collective where the optimizer is sharded (it has `save_shards`: Megatron's, in the RL policy and in
    the SFT job): rank 0 (holding `ckpt`) names its temp dir, each rank writes its shard there; rank 0 gets
    every file name, the others []. The torch Policy's optimizer is whole on rank 0: nothing to do. Rank 0
    without a writer (its temp dir could not be made) names none, and no rank writes; a rank whose shard
    write failed says so, and rank 0 raises CheckpointError once every rank has answered."""
    save_shards = getattr(optimizer, "save_shards", None)
    if save_shards is None:
        return []
    where = [str(ckpt.tmp) if ckpt is not None else None]
    dist.broadcast_object_list(where, src=0)
    mine: list[str] | str = []
    if where[0] is not None:
        try:
            mine = save_shards(Path(where[0]))
        except Exception as e:  # noqa: BLE001 - told to rank 0, which fails the save's try with it
            mine = f"rank {topo.rank}: {type(e).__name__}: {e}"
    written = [None] * topo.world_size
    dist.all_gather_object(written, mine)
    if ckpt is None:
        return []
    failed = [w for w in written if isinstance(w, str)]
    if failed:
        raise CheckpointError("optimizer shards not written: " + "; ".join(failed))
    return sorted(name for names in written for name in names)


def load(ckpt: Checkpoint, policy: RLPolicy, topo: Topology) -> dict:
    """Weights, optimizer (a sharded one then takes this rank's shard: `load_shards`), RNG; the RL state."""
    state = ckpt.load_tensors("model")
    loaded = policy.model.load_state_dict(state, strict=False)
    unexpected = getattr(loaded, "unexpected_keys", None)  # torch's; the Megatron view returns nothing
    if unexpected:  # e.g. train.lora switched on or off since the checkpoint: its tensors are not this model's
        raise CheckpointError(f"{ckpt.path}: {len(unexpected)} model tensors this policy does not have (first: "
                              f"{unexpected[0]!r}): was it written with another train.lora? Resume with the "
                              "run's own train: settings, or start a new run from its export")
    policy.optimizer.load_state_dict(ckpt.load_state("optimizer"))
    load_shards = getattr(policy.optimizer, "load_shards", None)
    if load_shards is not None:
        load_shards(ckpt)
    rng = ckpt.load_state("rng")[topo.rank]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return ckpt.load_json("rl_state")



def plain_state(rl_state: dict) -> dict:
    """rl_state as a checkpoint holds it: the experience made ahead (Controller.experience_buffer keeps the
    objects between saves) as JSON."""
    buffer = rl_state.get("experience_buffer")
    if not buffer:
        return rl_state
    return {**rl_state, "experience_buffer": [
        {"step": e["step"], "experience": e["experience"].to_json() if hasattr(e["experience"], "to_json")
         else e["experience"]} for e in buffer]}


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

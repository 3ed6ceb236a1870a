"""The RL checkpoint (rlslurm/rl/checkpointing.py) with an optimizer sharded over ranks (what Megatron's
distributed optimizer is), on two real gloo ranks and the real torch Policy: each rank writes its shard of
Adam's moments into rank 0's temp dir, the manifest covers every shard, and a fresh policy that loads the
checkpoint takes the next step exactly as the one that never stopped.

The sharding here is the test's own (`_ShardedAdam`: rank r keeps the moments of parameters r, r + 2,
...), because Megatron's optimizer needs CUDA; its shards go through the same `save_shards` /
`load_shards` calls, and tests/integration/test_megatron_policy.py resumes the Megatron policy on a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from procs import spawn_ranks
from rlslurm.checkpoint import Checkpoint, latest_complete, write_rank_state
from rlslurm.config import JobConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, free_port
from rlslurm.rl.checkpointing import load, save
from rlslurm.rl.experience import Sample
from rlslurm.rl.policy import Policy
from rlslurm.rundir import RunDir
from rlslurm.tokenizer import build_tokenizer


class _ShardedAdam:
    """AdamW whose checkpoint keeps the moments only in per-rank shards (rank r: parameters r, r + W, ...),
    the step and hyper-parameters in the rank-0 `optimizer.pt`, as the Megatron policy's OptimizerState."""

    def __init__(self, adam: torch.optim.AdamW, rank: int, world: int):
        self.adam, self.rank, self.world = adam, rank, world
        self.loaded: dict | None = None

    def __getattr__(self, name):  # zero_grad, step: the Policy trains through the wrapper
        return getattr(self.adam, name)

    def state_dict(self) -> dict:
        return {"param_groups": self.adam.state_dict()["param_groups"], "state": {}}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state

    def save_shards(self, directory: Path) -> list[str]:
        state = self.adam.state_dict()["state"]
        mine = {i: s for i, s in state.items() if i % self.world == self.rank}
        return [write_rank_state(directory, f"optimizer-rank{self.rank:03d}", mine)]

    def load_shards(self, ckpt: Checkpoint) -> None:
        state = {}
        for r in range(self.world):
            state.update(ckpt.load_state(f"optimizer-rank{r:03d}"))
        self.adam.load_state_dict({"param_groups": self.loaded["param_groups"], "state": state})


def _digest(policy: Policy) -> str:
    h = hashlib.sha256()
    for name, t in sorted(policy.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for _, s in sorted(policy.optimizer.adam.state_dict()["state"].items()):
        for key in ("exp_avg", "exp_avg_sq"):
            h.update(s[key].contiguous().numpy().tobytes())
    return h.hexdigest()


def _rank(rank: int, port: int, model_dir: str, run_dir: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    job = JobConfig()
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, lr=1e-2, seed=0))
    topo = Topology(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port)
    run = RunDir(Path(run_dir))
    guard = PhaseGuard(run, "train", rank, job.diag, faulthandler_fallback=False, background=False)
    tok = build_tokenizer()
    prompts = [list(tok(p)["input_ids"]) for p in ("12+7=", "3+4=")]
    answers = [list(tok(a)["input_ids"]) for a in ("19", "7")]
    steps = [[Sample(prompts[rank], answers[rank], 1.0, 1.0 if k % 2 == 0 else -0.5, 0, [0.0] * 2)]
             for k in range(3)]

    def policy() -> Policy:
        p = Policy(job, topo, Path(model_dir))
        p.optimizer = _ShardedAdam(p.optimizer, rank, 2)
        return p

    kept = policy()
    for k in range(2):
        kept.update(steps[k], guard, step_total=2)
    save(run, job, topo, kept, 2, 2, {})
    saved = _digest(kept)

    resumed = policy()
    ckpt = latest_complete(run) if rank == 0 else None
    path = [str(ckpt.path) if ckpt else None]
    dist.broadcast_object_list(path, src=0)
    load(Checkpoint.open(Path(path[0])), resumed, topo)
    loaded = _digest(resumed)
    kept.update(steps[2], guard, step_total=2)
    resumed.update(steps[2], guard, step_total=2)
    out[rank] = {"saved": saved, "loaded": loaded, "kept": _digest(kept), "resumed": _digest(resumed),
                 "files": sorted(Checkpoint.open(Path(path[0])).manifest["files"])}
    guard.close()
    dist.destroy_process_group()


def test_sharded_optimizer_state_is_checkpointed_by_its_ranks_and_resumes_exactly(init_and_run):
    result = spawn_ranks(_rank, (free_port(), *init_and_run))
    assert result[0]["files"] == ["model.safetensors", "optimizer-rank000.pt", "optimizer-rank001.pt",
                                  "optimizer.pt", "rl_state.json", "rng.pt"]
    for rank in (0, 1):
        r = result[rank]
        assert r["loaded"] == r["saved"], f"rank {rank}: weights or moments differ after load"
        assert r["resumed"] == r["kept"], f"rank {rank}: the step after the resume differs"
        assert r["kept"] != r["saved"]

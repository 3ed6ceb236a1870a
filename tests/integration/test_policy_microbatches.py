"""The torch policy's update in micro-batches (parallel.micro_batch_size) and mini-batches (rl.mini_batches)
on two real DDP ranks over gloo gives the loss and the gradients of one process that puts each whole
mini-batch through one forward: the sequence-level mean is exact across micro-batches and ranks of
different share sizes (7 samples: 4 on rank 0, 3 on rank 1), not a mean of per-rank or per-micro-batch
means, and gradient accumulation with DDP's no_sync all-reduces once per optimizer step.

    python -m pytest -q tests/integration/test_policy_microbatches.py     # ~40 s on 2 busy cores
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from procs import spawn_ranks
from rlslurm.config import JobConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, free_port
from rlslurm.rl.experience import Sample
from rlslurm.rl.policy import Policy
from rlslurm.rundir import RunDir

SAMPLES = 7
MINI_BATCHES = 2


def samples() -> list[Sample]:
    """Prompts and responses of different lengths, advantages of both signs, a third stale (the engine's
    log-probs are their behaviour policy)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(SAMPLES):
        prompt = [1] + torch.randint(4, 19, (3 + i % 4,), generator=g).tolist()
        response = torch.randint(4, 19, (1 + (i * 3) % 5,), generator=g).tolist() + [2]
        engine = (-torch.rand(len(response), generator=g) * 2).tolist()
        out.append(Sample(prompt, response, float(i % 2), 1.0 if i % 2 else -0.6 - 0.1 * i, 0, engine,
                          staleness=1 if i % 3 == 0 else 0))
    return out


def job(micro: int) -> JobConfig:
    base = JobConfig()
    return dataclasses.replace(
        base, train=dataclasses.replace(base.train, lr=1e-2, seed=0, grad_clip=0.0),
        parallel=dataclasses.replace(base.parallel, micro_batch_size=micro),
        rl=dataclasses.replace(base.rl, mini_batches=MINI_BATCHES))


def record_gradients(policy: Policy) -> list[dict[str, torch.Tensor]]:
    """The gradient each optimizer step applies (grad_clip is off: exactly what the loss made). The step is
    SGD's here: Adam's first step is lr x sign(gradient), which float noise flips where a gradient is ~0,
    and the second mini-batch's gradients would then differ by more than the first's rounding."""
    seen: list[dict[str, torch.Tensor]] = []
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.5)
    step = policy.optimizer.step

    def recording(*args, **kwargs):
        seen.append({n: p.grad.detach().clone() for n, p in policy.model.named_parameters()})
        return step(*args, **kwargs)

    policy.optimizer.step = recording
    return seen


MICRO = (1, 3, 64)
"""One sequence per forward; forwards of 3 (a rank's 4 as 3 + 1); each rank's whole share in one."""


def _rank(rank: int, port: int, model_dir: str, run_dir: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    topo = Topology(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port)
    guard = PhaseGuard(RunDir(Path(run_dir)), "train", rank, JobConfig().diag, faulthandler_fallback=False,
                       background=False)
    found = {}
    for micro in MICRO:
        policy = Policy(job(micro), topo, Path(model_dir))
        grads = record_gradients(policy)
        stats = policy.update(samples()[rank::2], guard, step_total=SAMPLES)  # what the RL loop deals
        found[micro] = {"stats": stats, "grads": grads}
    out[rank] = found
    guard.close()
    dist.destroy_process_group()


class _Guard:
    def beat(self, step=None):
        pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, each mini-batch whole in one forward: rank 0 of 1 holds all 7 samples, cut [4, 3], the
    same two mini-batches as the ranks' parts joined ({0, 1, 2, 3} and {4, 5, 6})."""
    from rlslurm.tinymodel import build_model, save_hf

    model_dir = tmp_path_factory.mktemp("init")
    save_hf(build_model(JobConfig().model, seed=0), model_dir)
    policy = Policy(job(micro=64), Topology(0, 1, 0, "127.0.0.1", 0), model_dir)
    grads = record_gradients(policy)
    return {"model_dir": str(model_dir), "stats": policy.update(samples(), _Guard()), "grads": grads}


def test_ddp_micro_batches_give_the_whole_batch_loss_and_gradients(reference, tmp_path):
    RunDir(tmp_path / "run").create()
    result = spawn_ranks(_rank, (free_port(), reference["model_dir"], str(tmp_path / "run")))
    ref_grads = reference["grads"]
    assert len(ref_grads) == MINI_BATCHES and reference["stats"]["mini_batches"] == MINI_BATCHES
    for rank, micro in ((r, m) for r in (0, 1) for m in MICRO):
        stats, grads = result[rank][micro]["stats"], result[rank][micro]["grads"]
        assert stats["mini_batches"] == MINI_BATCHES and len(grads) == MINI_BATCHES
        assert stats["loss"] == pytest.approx(reference["stats"]["loss"], abs=1e-6)
        for step, (ours, theirs) in enumerate(zip(grads, ref_grads)):
            scale = max(t.abs().max().item() for t in theirs.values())
            worst = max((ours[n] - theirs[n]).abs().max().item() for n in theirs)
            # step 0: the same weights, only the order of float sums differs; step 1 after one SGD step
            # on those (almost) equal gradients, with the behaviour log-probs of before step 0.
            assert worst <= 1e-5 * scale, (rank, micro, step, worst, scale)
    assert abs(reference["stats"]["loss"]) > 1e-3 and reference["stats"]["clip_fraction"] > 0

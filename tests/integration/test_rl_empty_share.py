"""Two real trainer ranks (DDP over gloo): a step where one rank's share of the samples is empty must
neither hang the other in DDP's all-reduce nor let the two ranks' weights drift apart."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from procs import spawn_ranks
from rlslurm.config import JobConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, free_port
from rlslurm.rl.experience import Sample
from rlslurm.rl.policy import Policy
from rlslurm.rundir import RunDir
from rlslurm.tokenizer import build_tokenizer


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _rank(rank: int, port: int, model_dir: str, run_dir: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=30))
    torch.manual_seed(0)
    job = JobConfig()
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, lr=1e-2, seed=0))
    topo = Topology(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port)
    guard = PhaseGuard(RunDir(Path(run_dir)), "train", rank, job.diag, faulthandler_fallback=False,
                       background=False)
    policy = Policy(job, topo, Path(model_dir))
    tok = build_tokenizer()
    prompt = list(tok("12+7=")["input_ids"])
    samples = [Sample(prompt, list(tok("19")["input_ids"]), 1.0, 1.0, 0, [0.0] * 2)]
    before = _digest(policy.model)
    # Rank 0 holds the step's only sample, rank 1 none: exp.samples[rank::world] with one sample.
    stats = policy.update(samples if rank == 0 else [], guard, step_total=1)
    digests = [None, None]
    dist.all_gather_object(digests, _digest(policy.model))
    out[rank] = {"before": before, "after": digests, "grad_norm": stats["grad_norm"]}
    guard.close()
    dist.destroy_process_group()


def test_a_rank_without_samples_stays_in_step_with_its_peer(init_and_run):
    result = spawn_ranks(_rank, (free_port(), *init_and_run))
    a, b = result[0], result[1]
    assert a["after"][0] == a["after"][1], "the ranks' weights drifted apart"
    assert a["after"][0] != a["before"], "the step did not change the weights"
    assert a["grad_norm"] == b["grad_norm"] > 0  # both stepped on the same averaged gradient

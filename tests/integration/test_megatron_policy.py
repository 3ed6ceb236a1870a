"""train.backend = megatron: the Megatron RL policy (rlslurm/megatron/policy.py) against the torch one.

    python -m pytest -q tests/integration/test_megatron_policy.py      # CPU: ~1-2 min on 2 cores; gpu tests skip

On CPU (gloo; the same code on a GPU under NCCL): the packed batch and the GRPO objective give the torch
Policy's loss to float precision (fresh and stale samples), and a real Megatron GPTModel loaded from the
embedded model's HF export gives transformers' log-probabilities through `token_logprobs` (labels aligned,
the checkpoint's RMSNorm epsilon used); split into mini-batches and micro-batches, the Megatron policy's
split (`prepare`) and its schedule's forward step give the torch Policy's loss of the same split. One
update through Megatron's DDP, distributed optimizer and schedule changes the weights, and the HF-named
weights round-trip (fp32 and bf16); two data-parallel ranks, each with its share, end with the weights one
rank gets from the whole batch; a resume from a checkpoint takes the next step as the uninterrupted run
(Adam's moments and master weights restored from the shards). On a GPU only (`@pytest.mark.gpu`): a weight
sync with VERIFY reaches a vLLM engine (IPC, one GPU) and an HF engine over NCCL (two GPUs); none has run yet
(docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlslurm.config import JobConfig
from rlslurm.logprobs import CausalLMScorer
from rlslurm.modelspec import ModelConfig
from rlslurm.rl.experience import Sample
from rlslurm.rl.objective import behaviour_logprobs, grpo_objective, pack
from rlslurm.rl.policy import Policy
from rlslurm.tokenizer import PAD_ID

# The embedded model at a head size vLLM's attention takes everywhere (64), two layers.
MODEL = ModelConfig(layers=2, hidden=128, heads=2, ffn_hidden=256, vocab=32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(**train) -> JobConfig:
    job = JobConfig()
    return dataclasses.replace(job, model=MODEL, train=dataclasses.replace(job.train, seed=0, **train))


def _export(path):
    from rlslurm.tinymodel import build_model, save_hf

    save_hf(build_model(MODEL, seed=0), path)
    return path


def _samples(stale: bool = False) -> list[Sample]:
    """Prompts and responses of different lengths (so right padding matters), advantages of both signs."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, (p, r) in enumerate([(6, 3), (4, 5), (7, 2), (5, 4), (3, 6), (6, 1)]):
        prompt = [1] + torch.randint(4, 19, (p - 1,), generator=g).tolist()
        response = torch.randint(4, 19, (r,), generator=g).tolist() + [2]
        engine = (-torch.rand(len(response), generator=g) * 3).tolist()
        out.append(Sample(prompt, response, float(i % 2), 1.0 if i % 2 else -0.7, 0, engine,
                          staleness=1 if stale and i % 3 == 0 else 0))
    return out


class _Guard:
    def beat(self, step=None):
        pass


# -- CPU --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stale", [False, True])
def test_objective_is_the_torch_policy_loss(tmp_path, stale):
    """The same samples and weights: grpo_objective over micro-batches sums to Policy.update's loss."""
    policy = Policy(_job(), _topology(), _export(tmp_path / "init"))
    samples = _samples(stale)
    batch = pack(samples, PAD_ID)
    ids = torch.cat([batch.tokens, batch.labels[:, -1:]], dim=1)
    with torch.no_grad():
        new = CausalLMScorer(policy.model, fused=False)(ids, (ids != PAD_ID).long())
    behaviour = behaviour_logprobs(batch, new)
    # Two micro-batches of a share: each is divided by the share's size, so they add up.
    ours = sum(float(grpo_objective(new[a:b], behaviour[a:b], batch.rows(a, b), 0.2, len(samples)))
               for a, b in [(0, 4), (4, 6)])
    theirs = policy.update(samples, _Guard())["loss"]
    assert ours == pytest.approx(theirs, abs=1e-6), (ours, theirs)
    assert abs(theirs) > 1e-3  # not trivially zero


def test_pack_aligns_labels_masks_responses_and_places_stale_engine_logprobs():
    samples = _samples(stale=True)
    batch = pack(samples, PAD_ID)
    s = samples[0]  # stale (i % 3 == 0)
    start, end = len(s.prompt_ids) - 1, len(s.prompt_ids) + len(s.response_ids) - 1
    assert batch.labels[0, start:end].tolist() == s.response_ids
    assert batch.mask[0].nonzero().flatten().tolist() == list(range(start, end))
    assert batch.engine_logprobs[0, start:end].tolist() == pytest.approx(s.engine_logprobs)
    assert batch.stale[:, 0].tolist() == [1.0 if i % 3 == 0 else 0.0 for i in range(len(samples))]
    old = torch.zeros_like(batch.mask)
    assert behaviour_logprobs(batch, old)[1].abs().sum() == 0  # fresh: the trainer's own
    empty = pack([], PAD_ID)
    assert (empty.samples, empty.tokens.shape[0], float(empty.mask.sum())) == (0, 1, 0.0)


def _topology():
    from rlslurm.dist import Topology

    return Topology(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0)


def _cpu_gpt(port: int, model_dir: str):
    """In a spawned process: a world of one over gloo, and Megatron's GPTModel on CPU loaded from model_dir."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.convert import Layout, SafetensorsDir, load_hf_into
    from rlslurm.megatron.model import build_gpt_model, init_parallel
    from rlslurm.megatron.policy import hf_model_spec

    init_process_group(Topology(0, 1, 0, "127.0.0.1", port), timeout_s=60)
    spec, eps = hf_model_spec(model_dir)
    init_parallel(Layout(), seed=1)
    gpt = build_gpt_model(spec, Layout(), parallel_output=True, layernorm_epsilon=eps)
    load_hf_into(gpt, SafetensorsDir(model_dir), spec, Layout())
    return gpt


def _logprobs_worker(rank: int, port: int, model_dir: str, out: str):
    from rlslurm.megatron.policy import token_logprobs

    gpt = _cpu_gpt(port, model_dir)
    batch = pack(_samples(), PAD_ID)
    with torch.no_grad():
        torch.save(token_logprobs(gpt.eval(), batch.tokens, batch.labels), out)


def test_megatron_logprobs_match_transformers_on_cpu(tmp_path):
    """The embedded model's export, loaded into Megatron's GPTModel: log p of every label as HF has it."""
    from rlslurm.megatron.policy import hf_model_spec

    model_dir = _export(tmp_path / "init")
    spec, eps = hf_model_spec(model_dir)
    assert (spec.hidden, spec.heads, spec.n_kv_heads, spec.vocab, spec.tie_embeddings, eps) == (
        128, 2, 2, 32, True, 1e-6)
    mp.spawn(_logprobs_worker, args=(_free_port(), str(model_dir), str(tmp_path / "lp.pt")), nprocs=1, join=True)
    megatron = torch.load(tmp_path / "lp.pt")
    policy = Policy(_job(), _topology(), model_dir)
    batch = pack(_samples(), PAD_ID)
    ids = torch.cat([batch.tokens, batch.labels[:, -1:]], dim=1)
    with torch.no_grad():
        hf = CausalLMScorer(policy.model, fused=False)(ids, torch.ones_like(ids))
    mask = batch.mask > 0
    diff = (megatron[mask] - hf[mask]).abs().max().item()
    assert diff < 1e-4, diff


def _fused_worker(rank: int, world: int, port: int, model_dir: str, out: str):
    """Plain (Megatron's vocab-parallel cross entropy) and fused (rlslurm/logprobs.py's chunked LM head) log-probs
    and weight gradients of one GPTModel split over `world` tensor-parallel ranks (real gloo)."""
    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.convert import Layout, SafetensorsDir, load_hf_into
    from rlslurm.megatron.model import build_gpt_model, init_parallel
    from rlslurm.megatron.policy import hf_model_spec, token_logprobs

    init_process_group(Topology(rank, world, 0, "127.0.0.1", port), timeout_s=60)
    spec, eps = hf_model_spec(model_dir)
    layout = Layout(tp=world)
    init_parallel(layout, seed=1)
    gpt = build_gpt_model(spec, layout, parallel_output=True, layernorm_epsilon=eps)
    load_hf_into(gpt, SafetensorsDir(model_dir), spec, layout)
    batch = pack(_samples(), PAD_ID)
    found = {}
    for fused in (False, True):
        gpt.zero_grad(set_to_none=True)
        lp = token_logprobs(gpt, batch.tokens, batch.labels, fused=fused)
        (lp * batch.mask).sum().backward()
        found[fused] = (lp.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None})
    torch.save(found, f"{out}.{rank}")


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_fused_ce_gives_the_plain_log_probs_and_gradients(tmp_path, tp):
    model_dir = _export(tmp_path / "init")
    mp.spawn(_fused_worker, args=(tp, _free_port(), str(model_dir), str(tmp_path / "out")), nprocs=tp, join=True)
    mask = pack(_samples(), PAD_ID).mask > 0
    for rank in range(tp):
        found = torch.load(tmp_path / f"out.{rank}")
        plain, fused = found[False], found[True]
        assert (fused[0][mask] - plain[0][mask]).abs().max().item() < 1e-5
        assert plain[1].keys() == fused[1].keys() and plain[1]
        for name, grad in plain[1].items():
            assert torch.allclose(fused[1][name], grad, atol=1e-5), (rank, name, (fused[1][name] - grad).abs().max())


def _split_job(rl: dict | None = None, mini_batches: int = 2, **train) -> JobConfig:
    """Two mini-batches of the six samples ([3, 3]), forwards of two sequences: micro-batches [2, 1] each (one
    mini-batch: [2, 2, 2], its behaviour log-probs taken from the training forward)."""
    job = _job(**train)
    return dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, micro_batch_size=2),
                               rl=dataclasses.replace(job.rl, mini_batches=mini_batches, **(rl or {})))


SWITCHES = {  # the rl: switches of the GRPO family the loss reads (rlslurm/rl/objective.py)
    "grpo": {},
    "dapo": {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "loss_agg": "token_mean"},
    "dr_grpo": {"loss_agg": "seq_sum_norm", "loss_norm_tokens": 16},
    "gspo": {"ratio": "sequence", "clip_eps_low": 0.03, "clip_eps_high": 0.04},
    "tis": {"tis_cap": 2.0, "max_staleness": 0},
}


def _split_loss_worker(rank: int, port: int, model_dir: str, out: str, mini_batches: int):
    """Megatron's side of the update on CPU: its split (`prepare`) and its schedule's forward_step and loss
    function per micro-batch, summed as the schedule reports them; no optimizer (Megatron's needs CUDA). Every
    switch of SWITCHES, fresh and stale samples."""
    from rlslurm.megatron.policy import _forward_step, prepare, token_logprobs
    from rlslurm.rl.objective import Objective, divisors

    gpt = _cpu_gpt(port, model_dir).eval()
    found = {}
    for name, rl in SWITCHES.items():
        job = _split_job(rl, mini_batches)
        objective = Objective.of(job)
        for stale in (False, True):
            samples = _samples(stale)
            parts, chunks, behaviour, stats = prepare(samples, [len(samples)], 0, job,
                                                      lambda c: token_logprobs(gpt, c.tokens, c.labels), "cpu")
            losses = []
            with torch.no_grad():
                for part_chunks, behave, divisor in zip(chunks, behaviour, divisors(objective, parts, 1)):
                    step = 0.0
                    for chunk, b in zip(part_chunks, behave):
                        nll, loss_func = _forward_step(objective, divisor, len(part_chunks), stats, False,
                                                       iter([(chunk, b)]), gpt)
                        _, reported = loss_func(nll)
                        step += float(reported["loss"])
                    losses.append(step)
            found[name, stale] = {"losses": losses, "micro": [len(c) for c in chunks], "stats": stats.result()}
    torch.save(found, out)


@pytest.mark.parametrize("mini_batches", [2, 1])
def test_megatron_and_torch_give_the_same_loss_for_the_same_micro_and_mini_batches(tmp_path, mini_batches):
    """The same samples, two mini-batches of micro-batches of two: the Megatron policy's split and
    objective (its schedule's forward_step on a CPU GPTModel) and the torch Policy's update report the same
    loss, for every switch of the GRPO family the loss reads (clip-higher + token mean, Dr. GRPO's constant
    normaliser, GSPO's sequence ratio, TIS). The torch policy steps after its first mini-batch; at lr 1e-9 that
    moves no log-prob past 1e-6, so the second mini-batch's loss is taken at the same weights on both sides. One
    mini-batch: both take the behaviour log-probs from the training forward (rlslurm/rl/config.py
    behaviour_forward)."""
    model_dir = _export(tmp_path / "init")
    mp.spawn(_split_loss_worker, args=(_free_port(), str(model_dir), str(tmp_path / "split.pt"), mini_batches),
             nprocs=1, join=True)
    losses = {}
    for (name, stale), megatron in torch.load(tmp_path / "split.pt").items():
        assert megatron["micro"] == ([2, 2] if mini_batches == 2 else [3])  # forwards of 2 and 1 / of 2, 2 and 2
        policy = Policy(_split_job(SWITCHES[name], mini_batches, lr=1e-9), _topology(), model_dir)
        stats = policy.update(_samples(stale), _Guard(), step_total=6)
        assert stats["mini_batches"] == mini_batches and stats["tokens"] == megatron["stats"]["tokens"]
        ours = sum(megatron["losses"]) / len(megatron["losses"])
        assert ours == pytest.approx(stats["loss"], abs=1e-5), (name, stale, megatron["losses"], stats["loss"])
        assert abs(ours) > 1e-3
        for key in ("tis_weight_mean", "engine_trainer_logprob_mismatch"):
            assert (key in stats) == (key in megatron["stats"])
            if key in stats:
                assert stats[key] == pytest.approx(megatron["stats"][key], abs=1e-4), key
        losses[name, stale] = ours
    for name in SWITCHES:  # each switch makes another loss of these (partly stale) samples: the comparison covers it
        assert name == "grpo" or abs(losses[name, True] - losses["grpo", True]) > 1e-4, name


# -- Megatron's DDP, distributed optimizer and schedule: on CPU over gloo here, on a GPU under NCCL ------

def _megatron_job(weight_bytes: float, **train) -> JobConfig:
    job = _job(backend="megatron", **train)
    return dataclasses.replace(job, memory=dataclasses.replace(job.memory, weight_bytes=weight_bytes))


def _policy_worker(rank: int, port: int, model_dir: str, out_dir: str, weight_bytes: float):
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.policy import MegatronPolicy, token_logprobs
    from rlslurm.tinymodel import load_hf

    topo = Topology(0, 1, 0, "127.0.0.1", port)
    init_process_group(topo, timeout_s=120)
    policy = MegatronPolicy(_megatron_job(weight_bytes, lr=1e-2), topo, model_dir)
    before = {n: t.clone() for n, t in policy.weights().items()}
    assert all(t.device == policy.device and t.dtype == torch.float32 for t in before.values())
    policy.meter.start_step(1)  # metered: the first step is, on every device
    stats = policy.update(_samples(stale=True), _Guard())
    peaks = policy.meter.peaks()
    after = policy.weights()
    assert sorted(after) == sorted(before)
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    assert len(changed) >= len(after) - 1, f"only {changed} changed"  # every matrix moves
    assert set(peaks) == {"forward_backward", "optimizer"} and all(p["tensor_gb"] > 0 for p in peaks.values())
    assert stats["grad_norm"] > 0 and stats["tokens"] > 0
    assert stats["engine_trainer_logprob_gap"] >= 0
    # A step with no trainable sample on any rank (every group zero-variance): no optimizer step, and the
    # trained step's keys all the same (docs/metrics.md), `trained: false` (issue 42).
    idle = policy.update([], _Guard(), step_total=0)
    assert set(idle) == set(stats) and (stats["trained"], idle["trained"]) == (True, False), (idle, stats)
    assert idle["grad_norm"] == idle["tokens"] == idle["mini_batches"] == 0
    assert all(torch.equal(t, after[n]) for n, t in policy.weights().items())

    # HF round trip 1: the HF directory the job exports reloads in transformers with the same log-probs.
    from rlslurm.tinymodel import save_hf

    save_hf(policy.model, os.path.join(out_dir, "hf"), tokenizer=policy.tokenizer)
    hf, _ = load_hf(os.path.join(out_dir, "hf"))
    batch = pack(_samples(), PAD_ID)
    ids = torch.cat([batch.tokens, batch.labels[:, -1:]], dim=1)
    with torch.no_grad():
        theirs = CausalLMScorer(hf, fused=False)(ids, torch.ones_like(ids))
        ours = token_logprobs(policy.gpt, batch.tokens.to(policy.device), batch.labels.to(policy.device)).cpu()
    mask = batch.mask > 0
    tolerance = 1e-4 if weight_bytes == 4.0 else 0.1  # bf16 compute against fp32 transformers
    assert (ours[mask] - theirs[mask]).abs().max().item() < tolerance

    # HF round trip 2: the checkpoint path (rlslurm/rl/checkpointing.py's load) puts HF tensors back into
    # Megatron exactly.
    policy.model.load_state_dict({n: t.cpu() for n, t in before.items()}, strict=False)
    back = policy.weights()
    if weight_bytes == 4.0:
        assert all(torch.equal(back[n].cpu(), before[n].cpu()) for n in before)
    state = policy.optimizer.state_dict()
    policy.optimizer.load_state_dict(state)
    assert state["steps"] == 1


@pytest.mark.parametrize("weight_bytes", [4.0, 2.0], ids=["fp32", "bf16"])
def test_megatron_policy_update_changes_weights_and_hf_weights_round_trip(tmp_path, weight_bytes):
    model_dir = _export(tmp_path / "init")
    mp.spawn(_policy_worker, args=(_free_port(), str(model_dir), str(tmp_path), weight_bytes), nprocs=1,
             join=True)


def _resume_worker(rank: int, port: int, model_dir: str, run_dir: str, mode: str, weight_bytes: float):
    """mode kept: steps 1-3, a checkpoint after step 2; resumed: load it, step 3; cold: load it without
    the optimizer shards (Adam from zero), step 3. Each writes its final HF weights to run_dir."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from rlslurm.checkpoint import latest_complete
    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.policy import MegatronPolicy
    from rlslurm.rl.checkpointing import load, save
    from rlslurm.rundir import RunDir

    topo = Topology(0, 1, 0, "127.0.0.1", port)
    init_process_group(topo, timeout_s=120)
    job = _megatron_job(weight_bytes, lr=1e-2)
    run = RunDir(Path(run_dir))
    policy = MegatronPolicy(job, topo, model_dir)
    steps = [_samples(stale=False), _samples(stale=True), _samples(stale=False)[::-1]]
    if mode == "kept":
        for k in range(2):
            policy.update(steps[k], _Guard())
        save(run, job, topo, policy, 2, 2, {})
        files = sorted(latest_complete(run).manifest["files"])
        assert "optimizer-rank00000.pt" in files, files
    else:
        ckpt = latest_complete(run)
        if mode == "cold":
            policy.optimizer.load_shards = lambda ckpt: None
        load(ckpt, policy, topo)
        assert policy.steps == 2
    policy.update(steps[2], _Guard())
    torch.save({n: t.cpu() for n, t in policy.weights().items()}, Path(run_dir) / f"{mode}.pt")


@pytest.mark.parametrize("weight_bytes", [4.0, 2.0], ids=["fp32", "bf16"])
def test_megatron_policy_resumes_with_its_adam_moments_and_master_weights(tmp_path, weight_bytes):
    """A checkpoint of the Megatron policy holds the distributed optimizer's shards: the step after a
    resume lands where the uninterrupted run's does, and a resume without them (Adam from zero) does not."""
    from rlslurm.rundir import RunDir

    model_dir = _export(tmp_path / "init")
    run = RunDir(tmp_path / "run").create()
    for mode in ("kept", "resumed", "cold"):  # one process each: a fresh Megatron, as after a requeue
        mp.spawn(_resume_worker, args=(_free_port(), str(model_dir), str(run.path), mode, weight_bytes),
                 nprocs=1, join=True)
    kept, resumed, cold = (torch.load(run.path / f"{m}.pt") for m in ("kept", "resumed", "cold"))
    resumed_gap = max((kept[n] - resumed[n]).abs().max().item() for n in kept)
    cold_gap = max((kept[n] - cold[n]).abs().max().item() for n in kept)
    print(f"resume vs uninterrupted: {resumed_gap:.3g}; without the moments: {cold_gap:.3g}", file=sys.stderr)
    assert cold_gap > 1e-3  # the moments matter at this lr: the test can tell
    assert resumed_gap <= 1e-6  # GPU kernels may reorder sums; the master weights and moments are exact


def _data_parallel_worker(rank: int, world: int, port: int, model_dir: str, out: str):
    """Megatron's policy over `world` gloo ranks (distributed optimizer: each rank steps its shard of Adam),
    each with its dealt share of the same six samples; rank 0 saves the weights after one update."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from rlslurm.dist import Topology, init_process_group
    from rlslurm.megatron.policy import MegatronPolicy

    topo = Topology(rank, world, rank, "127.0.0.1", port)
    init_process_group(topo, timeout_s=120)
    job = _megatron_job(4.0, lr=1e-2)
    assert job.resolved_memory.distributed_optimizer
    policy = MegatronPolicy(job, topo, model_dir)
    samples = _samples(stale=True)
    stats = policy.update(samples[rank::world], _Guard(), step_total=len(samples))
    if rank == 0:
        torch.save({"weights": {n: t.cpu() for n, t in policy.weights().items()}, "loss": stats["loss"],
                    "grad_norm": stats["grad_norm"]}, out)


def test_two_data_parallel_ranks_step_as_one_rank_with_the_whole_batch(tmp_path):
    """Megatron's DDP reduce-scatters the gradients into the distributed optimizer's shards and all-gathers
    the updated parameters: two ranks with half the samples each have the loss and gradient norm of one rank
    that has all of them (a gradient summed instead of averaged, or not reduced, would change the norm), and
    reach its weights. Adam's first step is lr x g / (|g| + eps): where a gradient is ~eps, the last bits of
    the reduction's order show, so the weights agree to 1 % of one step (lr 1e-2), not bit for bit."""
    model_dir = _export(tmp_path / "init")
    for world in (1, 2):
        mp.spawn(_data_parallel_worker, args=(world, _free_port(), str(model_dir), str(tmp_path / f"w{world}.pt")),
                 nprocs=world, join=True)
    from safetensors.torch import load_file

    one, two = torch.load(tmp_path / "w1.pt"), torch.load(tmp_path / "w2.pt")
    start = load_file(str(model_dir / "model.safetensors"))
    moved = min((one["weights"][n] - start[n]).abs().max().item() for n in one["weights"])
    assert moved > 1e-4  # every tensor moved: the comparison below can tell
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-6) and abs(one["loss"]) > 1e-3
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5) and one["grad_norm"] > 1e-3
    gap = max((one["weights"][n] - two["weights"][n]).abs().max().item() for n in one["weights"])
    assert gap < 1e-4, gap


def _sync(engine_client, transport, tensors, version):
    from rlslurm.sync.config import SyncConfig
    from rlslurm.sync.protocol import WeightSync

    try:
        return WeightSync([engine_client], transport, SyncConfig(timeout_s=120, retries=0)).sync(tensors, version)
    finally:
        transport.close()


def _start_engine(model_dir, log_dir, engine: str, visible: str, *extra: str):
    from rlslurm.rollout.launcher import spawn_engine
    from rlslurm.sync.broadcast import free_port

    env = {"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": visible, "RLSLURM_GPU_MEMORY_UTILIZATION": "0.2"}
    return spawn_engine(model_dir, port=free_port(), log_path=log_dir / "engine.log", engine=engine,
                        extra_args=["--name", "policy", *extra], env=env, ready_timeout_s=300.0)


def _new_weights(model_dir, device: str) -> dict[str, torch.Tensor]:
    """The model in model_dir with every tensor moved a little: what a trainer step would send."""
    from rlslurm.tinymodel import load_hf

    model, _ = load_hf(model_dir)
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = (t + 0.01 * torch.randn_like(t)).to(device).contiguous()
    return out


def _assert_verified(report, client, tensors):
    from rlslurm.sync.checksum import checksums, compare

    assert report.attempts == 1 and report.stages["update"].bytes > 0
    # VERIFY passed inside sync(); ask the engine once more what it serves now.
    assert not compare(checksums(tensors.items()), client.checksums())
    assert client.version() == 1


@pytest.mark.gpu
def test_ipc_sync_to_a_vllm_engine_on_the_same_gpu_passes_verify(tmp_path):
    """The colocated path of bench/gpu_smoke.sh: trainer tensors on cuda:0, vLLM on the same GPU."""
    pytest.importorskip("vllm", reason="needs the [gpu] extra (vllm)")
    from rlslurm.sync.ipc import IpcTransport

    model_dir = _export(tmp_path / "init")
    engine = _start_engine(model_dir, tmp_path, "vllm", "0")
    try:
        tensors = _new_weights(model_dir, "cuda:0")
        report = _sync(engine.client, IpcTransport(bucket_mb=1.0), tensors, version=1)
        _assert_verified(report, engine.client, tensors)
    finally:
        engine.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL refuses two ranks on one GPU ('Duplicate GPU detected'): needs 2 GPUs")
@pytest.mark.parametrize("engine_kind", ["hf", "vllm"])  # vllm: lands in place, into the group's GPU scratch
def test_nccl_broadcast_sync_to_an_engine_on_a_second_gpu_passes_verify(tmp_path, engine_kind):
    if engine_kind == "vllm":
        pytest.importorskip("vllm", reason="needs the [gpu] extra (vllm)")
    from rlslurm.sync.broadcast import BroadcastTransport

    model_dir = _export(tmp_path / "init")
    # The engine sees only the second GPU (its cuda:0); this process's tensors stay on cuda:0.
    extra = ("--device", "cuda") if engine_kind == "hf" else ()
    engine = _start_engine(model_dir, tmp_path, engine_kind, "1", *extra)
    try:
        torch.cuda.set_device(0)
        tensors = _new_weights(model_dir, "cuda:0")
        report = _sync(engine.client, BroadcastTransport("127.0.0.1", bucket_mb=1.0), tensors, version=1)
        _assert_verified(report, engine.client, tensors)
        print(f"NCCL sync: {report.stages['update'].gbps:.3f} GB/s", file=sys.stderr)
    finally:
        engine.stop()

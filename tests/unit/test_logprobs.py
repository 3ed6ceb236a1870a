"""rlslurm/logprobs.py: the fused (chunked) token log-probabilities equal the plain ones, values and
gradients, on hand-built tensors, on the embedded Llama, split over a real 2-rank gloo tensor-parallel
group, and hold what the plan says they save: the logits never materialise."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlslurm.errors import ConfigError
from rlslurm.logprobs import CausalLMScorer, plain_logprobs, sft_loss, token_logprobs
from rlslurm.memory_meter import MemoryMeter, owned_tensors
from rlslurm.modelspec import ModelConfig
from rlslurm.tinymodel import build_model


def _tensors(n=11, h=16, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(vocab, h, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 3, 11, 64])
def test_chunked_values_and_gradients_equal_the_plain_path(chunk):
    hidden, weight, labels = _tensors()
    upstream = torch.randn(hidden.shape[0])
    plain = plain_logprobs(hidden, weight, labels)
    (plain * upstream).sum().backward()
    want = (plain.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    fused = token_logprobs(hidden, weight, labels, fused=True, chunk=chunk)
    (fused * upstream).sum().backward()
    for got, expected in zip((fused.detach(), hidden.grad, weight.grad), want):
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("vocab", [32, 1000])
def test_the_scorer_on_the_embedded_llama_gives_the_plain_log_probs_and_weight_gradients(vocab):
    model = build_model(ModelConfig(layers=2, hidden=32, heads=4, ffn_hidden=64, vocab=vocab), seed=0)
    ids = torch.randint(0, vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0  # right padding, as the trainers pack
    found = {}
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        lp = CausalLMScorer(model, fused=fused)(ids, mask)
        (lp * mask[:, 1:]).sum().backward()
        found[fused] = (lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.allclose(found[True][0], found[False][0], atol=1e-5)
    for name, grad in found[False][1].items():
        assert torch.allclose(found[True][1][name], grad, atol=1e-5), name


def test_sft_loss_is_the_hf_causal_lm_loss_over_labelled_tokens():
    model = build_model(ModelConfig(layers=1, hidden=32, heads=4, ffn_hidden=64, vocab=32), seed=0)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt is not learned
    labels[1, 7] = -100
    hf = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
    for fused in (False, True):
        ours = sft_loss(CausalLMScorer(model, fused=fused)(ids, torch.ones_like(ids), labels), labels)
        assert ours.item() == pytest.approx(hf.item(), abs=1e-6)


def test_fused_is_refused_for_a_head_it_cannot_reproduce():
    model = build_model(ModelConfig(layers=1, hidden=32, heads=4, ffn_hidden=64, vocab=32), seed=0)
    model.lm_head = torch.nn.Linear(32, 32, bias=True)
    with pytest.raises(ConfigError, match="memory.fused_ce"):
        CausalLMScorer(model, fused=True)


def _vocab_parallel(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hidden, weight, labels = _tensors(n=9, vocab=40)
    upstream = torch.randn(9, generator=torch.Generator().manual_seed(3))
    part = weight.detach()[rank * 20:(rank + 1) * 20].clone().requires_grad_()
    lp = token_logprobs(hidden, part, labels, fused=True, group=dist.group.WORLD, chunk=4)
    (lp * upstream).sum().backward()
    torch.save({"lp": lp.detach(), "hidden_grad": hidden.grad, "weight_grad": part.grad}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_tensor_parallel_ranks_each_holding_half_the_vocabulary_give_the_whole_log_probs(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_vocab_parallel, args=(2, port, str(tmp_path / "out")), nprocs=2)
    hidden, weight, labels = _tensors(n=9, vocab=40)
    upstream = torch.randn(9, generator=torch.Generator().manual_seed(3))
    plain = plain_logprobs(hidden, weight, labels)
    (plain * upstream).sum().backward()
    ranks = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    for r in ranks:
        assert torch.allclose(r["lp"], plain.detach(), atol=1e-5)
        assert torch.allclose(r["hidden_grad"], hidden.grad, atol=1e-5)
    assert torch.allclose(torch.cat([r["weight_grad"] for r in ranks]), weight.grad, atol=1e-5)


def test_fused_ce_saves_at_least_80_percent_of_the_plans_logits_term_where_logits_dominate():
    """What `memory.fused_ce` promises in the plan (rlslurm/plan/memory.py: b x s x vocab x 4 B x 2) is
    measured here: the peak of live tensor bytes of one forward + backward, plain vs fused, vocab 32k."""
    torch.manual_seed(0)
    b, s, vocab = 4, 128, 32_000
    model = build_model(ModelConfig(layers=1, hidden=64, heads=4, ffn_hidden=128, vocab=vocab, max_positions=s),
                        seed=0)
    ids = torch.randint(0, vocab, (b, s))
    peaks = {}
    for fused in (False, True):
        meter = MemoryMeter(torch.device("cpu"), every_steps=1, owned=lambda: owned_tensors(model))
        meter.start_step(1)
        with meter.measure("forward_backward"):
            CausalLMScorer(model, fused=fused)(ids, torch.ones_like(ids)).sum().backward()
        model.zero_grad(set_to_none=True)
        peaks[fused] = meter.peaks()["forward_backward"]["tensor_gb"]
    plan_logits_gb = b * s * vocab * 4 * 2 / 1e9
    assert peaks[False] - peaks[True] >= 0.8 * plan_logits_gb, (peaks, plan_logits_gb)

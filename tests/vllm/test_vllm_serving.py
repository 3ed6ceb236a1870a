"""vLLM's own server (rollout.engine: vllm) serving on loopback: greedy tokens and logprobs equal HF
transformers', the OpenAI surface (n samples, seed, logprobs, version stamps), concurrent callers each get
exactly their tokens, throughput. The server is conftest.py's session `engine`, which the sync tests move
between seeds: each test first tells which model it serves."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai

from rlslurm.rollout.engine import HFEngine, SamplingParams
from rollout_fixtures import PROMPTS, served_tokens


def serving_seed(engine, reference) -> int:
    """Which model the engine serves now, told by its greedy tokens (the sync tests move it)."""
    out = served_tokens(engine.client.completions(PROMPTS, max_tokens=8, temperature=0))
    matches = [s for s, toks in reference.items() if toks == out]
    assert len(matches) == 1, f"vLLM greedy tokens {out} match no HF reference exactly: {reference}"
    return matches[0]


def test_greedy_tokens_and_logprobs_equal_transformers(engine, models, reference):
    assert len({str(toks) for toks in reference.values()}) == len(reference)  # the models tell apart
    seed = serving_seed(engine, reference)
    out = engine.client.completions(PROMPTS, max_tokens=8, temperature=0)
    hf = HFEngine(models[1][seed]).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    gap = max(abs(a - b) for c, [h] in zip(out["choices"], hf) for a, b in zip(c["token_logprobs"], h.logprobs))
    print(f"FIGURE vllm_vs_hf_greedy: {len(PROMPTS)}/{len(PROMPTS)} prompts equal, max |dlogprob| {gap:.2e}")
    assert served_tokens(out) == [h.token_ids for [h] in hf]
    assert gap < 1e-4
    assert [c["finish_reason"] for c in out["choices"]] == [h.finish_reason for [h] in hf]


def test_openai_client_gets_seeded_samples_with_logprobs(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key=engine.client.token, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["policy"]

    def sample():
        return client.completions.create(model="policy", prompt="abc", n=3, max_tokens=6, temperature=1.0,
                                          seed=7, logprobs=1, extra_body={"return_token_ids": True})

    first, again = sample(), sample()
    tokens = [c.model_extra["token_ids"] for c in first.choices]
    assert tokens == [c.model_extra["token_ids"] for c in again.choices]  # a seed fixes the samples
    assert len({str(t) for t in tokens}) > 1  # ... but the n samples of one request differ
    for c in first.choices:
        assert 1 <= len(c.model_extra["token_ids"]) <= 6
        assert len(c.logprobs.token_logprobs) == len(c.model_extra["token_ids"])
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    # The same request through rlslurm's client carries the weight version that produced it.
    ours = engine.client.completions(["abc"], n=3, max_tokens=6, temperature=1.0, seed=7)
    assert [c["token_ids"] for c in ours["choices"]] == tokens
    assert ours["policy_version"] == engine.client.version()


def test_concurrent_callers_each_get_exactly_their_tokens(engine, reference):
    seed = serving_seed(engine, reference)
    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda i: engine.client.completions([PROMPTS[i % 6]], max_tokens=8, temperature=0),
                             range(24)))
    for i, out in enumerate(outs):
        assert served_tokens(out) == [reference[seed][i % 6]]


def test_throughput_figure(engine):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    engine.client.completions(prompts[:2], max_tokens=4, temperature=1.0)  # warm
    started = time.monotonic()
    out = engine.client.completions(prompts, max_tokens=32, temperature=1.0, seed=0)
    seconds = time.monotonic() - started
    tokens = out["usage"]["completion_tokens"]
    print(f"FIGURE vllm_throughput: {tokens} tokens, batch 32, {seconds:.2f} s, {tokens / seconds:.0f} tok/s")
    assert tokens > 32

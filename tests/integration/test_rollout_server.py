"""The rollout engine server as a real process on loopback: the OpenAI surface (a real `openai`
client), version stamps, batching of concurrent callers, and the drain / resume / verify gates."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from rlslurm.rollout.client import EngineRequestError
from rlslurm.rollout.engine import HFEngine
from rlslurm.sync.checksum import checksums
from rlslurm.sync.disk import write_weights
from rollout_fixtures import PROMPTS, greedy_tokens, save_model, served_tokens, start_engine, tiny_llama, weights


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {seed: save_model(tiny_llama(seed), root / f"m{seed}") for seed in (0, 1)}


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    proc = start_engine(models[0], tmp_path_factory.mktemp("logs"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(models):
    return {seed: greedy_tokens(HFEngine(path)) for seed, path in models.items()}


def test_openai_client_gets_versioned_completions(engine, reference):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key=engine.client.token, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["policy"]
    out = client.completions.create(model="policy", prompt=PROMPTS[:2], n=2, max_tokens=8, temperature=0)
    assert len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.model_extra["policy_version"] == 0
    tokens = [c.model_extra["token_ids"] for c in out.choices]
    # choices are prompt-major: prompt i's n samples sit at i*n .. i*n+n-1
    assert tokens == [reference[0][0]] * 2 + [reference[0][1]] * 2
    assert out.choices[0].text and out.usage.completion_tokens == 32

    sampled = client.completions.create(model="policy", prompt="abc", n=3, max_tokens=6, temperature=1.0,
                                        seed=7, logprobs=1)
    assert len(sampled.choices) == 3
    for c in sampled.choices:
        assert 1 <= len(c.model_extra["token_ids"]) <= 6
        assert len(c.logprobs.token_logprobs) == len(c.model_extra["token_ids"])
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)


def test_concurrent_callers_are_batched_and_exact(engine, reference):
    before = engine.client.health()["batches"]
    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda i: engine.client.completions([PROMPTS[i % 6]], max_tokens=8, temperature=0),
                             range(24)))
    for i, out in enumerate(outs):
        assert served_tokens(out) == [reference[0][i % 6]]
        assert out["policy_version"] == 0
    batches = engine.client.health()["batches"] - before
    assert batches < 24, "concurrent requests were not merged into shared generate calls"


def test_drain_refuses_then_update_must_verify_before_resume(engine, models, reference, tmp_path):
    c = engine.client
    assert c.drain(timeout_s=10)["state"] == "drained"
    with pytest.raises(EngineRequestError) as refused:
        c.completions(["abc"], max_tokens=4)
    assert refused.value.status == 503 and refused.value.retry_after_s == 1.0

    new = weights(tiny_llama(1))
    path = write_weights(new, tmp_path, version=1)
    c.update_disk(str(path), timeout_s=30)
    with pytest.raises(EngineRequestError) as unverified:
        c.resume(1, timeout_s=10)
    assert unverified.value.status == 409 and "not verified" in str(unverified.value)

    wrong = dict(checksums(new.items()), **{"lm_head.weight": "float32[46,32]:0:0"})
    verdict = c.verify(wrong, timeout_s=30)
    assert not verdict["ok"] and verdict["mismatches"][0]["name"] == "lm_head.weight"
    with pytest.raises(EngineRequestError):
        c.resume(1, timeout_s=10)

    assert c.verify(checksums(new.items()), timeout_s=30)["ok"]
    c.resume(1, timeout_s=10)
    out = c.completions(PROMPTS, max_tokens=8, temperature=0)
    assert out["policy_version"] == 1 and served_tokens(out) == reference[1]

    # Back to version 0 so the module's other tests see the weights they expect.
    c.drain(timeout_s=10)
    old = weights(tiny_llama(0))
    c.update_disk(str(write_weights(old, tmp_path, version=2)), timeout_s=30)
    assert c.verify(checksums(old.items()), timeout_s=30)["ok"]
    c.resume(0, timeout_s=10)
    assert served_tokens(c.completions(PROMPTS, max_tokens=8, temperature=0)) == reference[0]


def test_bad_requests_are_400(engine):
    with pytest.raises(EngineRequestError) as e:
        engine.client.completions([], max_tokens=4)
    assert e.value.status == 400
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key=engine.client.token, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="policy", prompt="abc", max_tokens=4, stream=True)

"""Weight sync end to end, per transport: a real engine server process, the real protocol run from
this process as the trainer's rank 0, real safetensors files / gloo group / shared memory."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlslurm.errors import SyncVerifyError
from rlslurm.events import read_events
from rlslurm.rollout.client import EngineRequestError
from rlslurm.rollout.engine import HFEngine
from rlslurm.rundir import RunDir
from rlslurm.sync.broadcast import BroadcastTransport
from rlslurm.sync.buckets import Fault
from rlslurm.sync.checksum import checksums
from rlslurm.sync.config import SyncConfig
from rlslurm.sync.disk import DiskTransport
from rlslurm.sync.ipc import IpcTransport
from rlslurm.sync.protocol import WeightSync
from rollout_fixtures import PROMPTS, greedy_tokens, save_model, served_tokens, start_engine, tiny_llama, weights

TRANSPORTS = ["disk", "broadcast", "ipc"]
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {s: tiny_llama(s) for s in SEEDS}, {s: save_model(tiny_llama(s), root / f"m{s}") for s in SEEDS}


@pytest.fixture(scope="module")
def reference(models):
    return {s: greedy_tokens(HFEngine(path)) for s, path in models[1].items()}


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    proc = start_engine(models[1][0], tmp_path_factory.mktemp("logs"))
    yield proc
    proc.stop()


def make_transport(kind: str, tmp_path, fault=None, bucket_mb=0.02):
    if kind == "disk":
        return DiskTransport(tmp_path / "weights", fault=fault)
    if kind == "broadcast":
        return BroadcastTransport("127.0.0.1", bucket_mb=bucket_mb, fault=fault)
    return IpcTransport(bucket_mb=bucket_mb, fault=fault)


def sync_to(engine, kind, seed, models, tmp_path, *, fault=None, retries=1, run=None, bucket_mb=0.02):
    version = engine.client.version() + 1
    transport = make_transport(kind, tmp_path, fault, bucket_mb)
    try:
        proto = WeightSync([engine.client], transport, SyncConfig(timeout_s=30, retries=retries), run=run)
        return proto.sync(weights(models[0][seed]), version)
    finally:
        transport.close()


def current_seed(engine, reference):
    out = served_tokens(engine.client.completions(PROMPTS, max_tokens=8, temperature=0))
    (seed,) = [s for s, toks in reference.items() if toks == out]
    return seed


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_sync_serves_the_new_weights_with_the_next_version(kind, engine, models, reference, tmp_path):
    old_seed = current_seed(engine, reference)
    new_seed = (old_seed + 1) % len(SEEDS)
    before = engine.client.version()
    report = sync_to(engine, kind, new_seed, models, tmp_path)
    out = engine.client.completions(PROMPTS, max_tokens=8, temperature=0)
    assert out["policy_version"] == before + 1
    assert served_tokens(out) == reference[new_seed] != reference[old_seed]
    total = sum(t.numel() * t.element_size() for t in weights(models[0][new_seed]).values())
    assert report.attempts == 1
    assert report.stages["update"].bytes == total
    assert report.metrics()["sync_update_gbps"] > 0 and report.metrics()["sync_verify_s"] > 0


def fail_a_corrupted_sync(engine, kind, models, reference, tmp_path) -> tuple[int, int, int]:
    """A sync to the next seed whose up_proj is corrupted in flight on the first try and its one retry:
    VERIFY fails it, naming the tensor, with the events that say so. Returns (old seed, new seed, version before)."""
    old_seed = current_seed(engine, reference)
    new_seed = (old_seed + 1) % len(SEEDS)
    before = engine.client.version()
    run = RunDir(tmp_path / "run").create()
    fault = Fault("model.layers.1.mlp.up_proj.weight")
    sent = checksums(weights(models[0][new_seed]).items())
    with pytest.raises(SyncVerifyError) as failed:
        sync_to(engine, kind, new_seed, models, tmp_path, fault=fault, retries=1, run=run)
    assert "model.layers.1.mlp.up_proj.weight" in str(failed.value) and "2 times" in str(failed.value)
    assert fault.hits == 2  # the first try and its one retry
    assert checksums(weights(models[0][new_seed]).items()) == sent  # only copies in flight were hit
    kinds = [e["kind"] for e in read_events(run)]
    assert kinds == ["sync_verify_mismatch", "sync_verify_mismatch", "sync_verify_failed"]
    return old_seed, new_seed, before


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_tensor_corrupted_in_flight_is_never_served(kind, engine, models, reference, tmp_path):
    old_seed, _, before = fail_a_corrupted_sync(engine, kind, models, reference, tmp_path)
    health = engine.client.health()
    assert health["state"] == "drained" and health["version"] == before and health["verified"]
    with pytest.raises(EngineRequestError) as refused:
        engine.client.completions(PROMPTS, max_tokens=8, temperature=0)
    assert refused.value.status == 503

    # The rollback restored the last verified weights: serving them again is allowed and exact.
    engine.client.resume(before, timeout_s=10)
    out = engine.client.completions(PROMPTS, max_tokens=8, temperature=0)
    assert out["policy_version"] == before and served_tokens(out) == reference[old_seed]


@pytest.mark.parametrize("kind", ["broadcast", "ipc"])
def test_one_tensor_per_bucket_pipelines_and_corrupts_only_a_copy(kind, engine, models, reference, tmp_path):
    # Buckets of 1 KB: every tensor travels alone (broadcast sends it without a flatten copy), and
    # many buckets are in flight at once on both sides.
    new_seed = (current_seed(engine, reference) + 1) % len(SEEDS)
    sent = checksums(weights(models[0][new_seed]).items())
    fault = Fault("model.layers.0.self_attn.q_proj.weight", times=1)
    report = sync_to(engine, kind, new_seed, models, tmp_path, fault=fault, bucket_mb=0.001)
    assert report.attempts == 2 and fault.hits == 1
    assert checksums(weights(models[0][new_seed]).items()) == sent
    assert served_tokens(engine.client.completions(PROMPTS, max_tokens=8, temperature=0)) == reference[new_seed]


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_corruption_that_a_retry_fixes_passes(kind, engine, models, reference, tmp_path):
    new_seed = (current_seed(engine, reference) + 1) % len(SEEDS)
    fault = Fault("model.embed_tokens.weight", times=1)
    report = sync_to(engine, kind, new_seed, models, tmp_path, fault=fault, retries=1)
    assert report.attempts == 2 and fault.hits == 1
    assert served_tokens(engine.client.completions(PROMPTS, max_tokens=8, temperature=0)) == reference[new_seed]


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_requests_during_a_sync_each_come_from_exactly_one_version(kind, engine, models, reference, tmp_path):
    old_seed = current_seed(engine, reference)
    new_seed = (old_seed + 1) % len(SEEDS)
    old_version = engine.client.version()
    stop = threading.Event()
    seen: list[tuple[int, list]] = []
    refusals = [0]

    def fire(i):
        while not stop.is_set():
            try:
                out = engine.client.completions(PROMPTS[i % 3 :: 3], max_tokens=8, temperature=0)
            except EngineRequestError as e:
                if e.status != 503:
                    raise
                refusals[0] += 1
                stop.wait(0.05)  # honour Retry-After, scaled down: the test wants many tries
                continue
            seen.append((i % 3, out))

    with ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(fire, i) for i in range(4)]
        deadline = time.monotonic() + 60
        while len(seen) < 4 and time.monotonic() < deadline:
            stop.wait(0.05)
        sync_to(engine, kind, new_seed, models, tmp_path)
        n_before = len(seen)
        while len(seen) < n_before + 4 and time.monotonic() < deadline:
            stop.wait(0.05)
        stop.set()
        for w in workers:
            w.result()

    versions = {out["policy_version"] for _, out in seen}
    assert versions == {old_version, old_version + 1}
    for group, out in seen:
        assert {c["policy_version"] for c in out["choices"]} == {out["policy_version"]}
        seed = old_seed if out["policy_version"] == old_version else new_seed
        assert served_tokens(out) == reference[seed][group::3]

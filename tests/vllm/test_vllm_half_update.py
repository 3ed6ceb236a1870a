"""VERIFY against vLLM's CPU weight packing: an update that skips the re-pack is caught, the real one passes.

vLLM's CPU backend packs each linear layer's weight into a GEMM handle and drops the parameter. An
update that copies new values into parameters but does not re-pack leaves generation on the old
packed weights while norms and embeddings are new: a silent half-update. The engine server's
`--debug-skip-repack` does exactly that; the engine's checksums read each GEMM's weight back through
the GEMM, so VERIFY sees it.
"""

from __future__ import annotations

import pytest

from rlslurm.errors import SyncVerifyError
from rlslurm.sync.broadcast import BroadcastTransport
from rlslurm.sync.checksum import checksums
from rlslurm.sync.config import SyncConfig
from rlslurm.sync.disk import DiskTransport
from rlslurm.sync.ipc import IpcTransport
from rlslurm.sync.protocol import WeightSync
from rollout_fixtures import PROMPTS, served_tokens, weights
from vllm_fixtures import start_vllm


@pytest.fixture(scope="module")
def half_engine(models, vllm_python, tmp_path_factory):
    proc = start_vllm(models[1][0], tmp_path_factory.mktemp("vllm-half-logs"), vllm_python, "--debug-skip-repack")
    yield proc
    proc.stop(timeout_s=30)


def sync(engine, tensors, version, tmp_path, kind="disk", **config):
    transport = {"disk": lambda: DiskTransport(tmp_path / "weights"), "ipc": IpcTransport,
                 "broadcast": lambda: BroadcastTransport("127.0.0.1")}[kind]()
    try:
        return WeightSync([engine.client], transport, SyncConfig(timeout_s=60, **config)).sync(tensors, version)
    finally:
        transport.close()


def greedy(engine):
    return served_tokens(engine.client.completions(PROMPTS, max_tokens=8, temperature=0))


def test_an_update_without_the_repack_fails_verify_and_is_not_served(half_engine, models, reference, tmp_path):
    assert greedy(half_engine) == reference[0]
    with pytest.raises(SyncVerifyError) as failed:
        sync(half_engine, weights(models[0][1]), 1, tmp_path, retries=1)
    assert "proj.weight" in str(failed.value)  # a packed linear layer is what differs
    health = half_engine.client.health()
    assert health["state"] == "drained" and health["version"] == 0 and health["verified"]
    half_engine.client.resume(0, timeout_s=10)
    assert greedy(half_engine) == reference[0]  # rolled back: the last verified weights, exactly

    # What VERIFY prevented: with it switched off the same update is served, and it is neither model.
    sync(half_engine, weights(models[0][1]), 1, tmp_path, verify=False)
    served = greedy(half_engine)
    assert served != reference[1] and served != reference[0]
    sums, want = half_engine.client.checksums(), checksums(weights(models[0][1]).items())
    stale = sorted(n for n in want if sums[n] != want[n])
    assert "model.norm.weight" not in stale and "model.layers.0.self_attn.q_proj.weight" in stale
    assert all(n.endswith("proj.weight") or n == "lm_head.weight" for n in stale), stale


@pytest.mark.parametrize("kind", ["disk", "broadcast", "ipc"])
def test_the_same_update_with_the_repack_passes(kind, engine, models, reference, tmp_path):
    version = engine.client.version()
    current = greedy(engine)
    new_seed = next(s for s, toks in reference.items() if toks != current)
    report = sync(engine, weights(models[0][new_seed]), version + 1, tmp_path, kind)
    assert report.attempts == 1 and greedy(engine) == reference[new_seed]
    update, verify = report.stages["update"], report.stages["verify"]
    print(f"FIGURE vllm_{kind}_sync (64 MB buckets): {update.bytes / 1e6:.2f} MB, update "
          f"{update.seconds * 1e3:.0f} ms, verify {verify.seconds * 1e3:.0f} ms, total {report.seconds * 1e3:.0f} ms")

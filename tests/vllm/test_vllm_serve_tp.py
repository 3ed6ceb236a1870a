"""A tensor-parallel (TP 2) vLLM server on the CPU backend through verified syncs: its two workers each
serve a shard of every linear layer, VERIFY gathers them back into Hugging Face tensors inside the
workers, and a corruption that reaches one TP shard only is caught by name.

On this 2-core box TP 2 needs each worker's threads bound to a core of its own (VLLM_CPU_OMP_THREADS_BIND
"0|1") and a low --gpu-memory-utilization; rollout/vllm_serve.py sets both for a CPU engine with tp > 1.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from rlslurm.errors import SyncVerifyError
from rlslurm.rollout.client import EngineRequestError
from rlslurm.rollout.engine import HFEngine
from rlslurm.sync.broadcast import BroadcastTransport
from rlslurm.sync.buckets import Fault
from rlslurm.sync.checksum import checksums, compare
from rlslurm.sync.config import SyncConfig
from rlslurm.sync.disk import DiskTransport
from rlslurm.sync.ipc import IpcTransport
from rlslurm.sync.protocol import WeightSync
from rollout_fixtures import PROMPTS, greedy_tokens, save_model, served_tokens, tiny_llama, weights
from vllm_fixtures import start_vllm_serve


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """({seed: model}, {seed: HF dir}, {seed: HF greedy tokens}) of tiny Llamas with a tied embedding (as the
    embedded default has): vLLM serves that matrix twice, the lookup table and the LM head's own GEMM."""
    root = tmp_path_factory.mktemp("vllm-tied")
    live = {s: tiny_llama(s, hidden=128, tied=True) for s in (0, 1, 2)}  # head size 32: vLLM's CPU attention
    dirs = {s: save_model(m, root / f"m{s}") for s, m in live.items()}
    return live, dirs, {s: greedy_tokens(HFEngine(path)) for s, path in dirs.items()}


@pytest.fixture(scope="module")
def tp_engine(tied, vllm_python, tmp_path_factory):
    proc = start_vllm_serve(tied[1][0], tmp_path_factory.mktemp("vllm-tp2-logs"), vllm_python, tp=2)
    yield proc
    proc.stop(timeout_s=30)


def sync(engine, transport, tensors, **config):
    try:
        proto = WeightSync([engine.client], transport, SyncConfig(timeout_s=60, **config))
        return proto.sync(tensors, engine.client.version() + 1)
    finally:
        transport.close()


def greedy(engine):
    return served_tokens(engine.client.completions(PROMPTS, max_tokens=8, temperature=0))


def test_tp2_serves_the_checkpoint_and_takes_verified_syncs(tp_engine, tied, tmp_path):
    models, reference = tied[:2], tied[2]
    workers = tp_engine.client._post("/collective_rpc", method="rlslurm_checksums")["results"]
    assert len(workers) == 2  # two TP workers, each reporting the whole HF tensors it gathered
    start = checksums(load_file(str(models[1][0] / "model.safetensors")).items())
    assert not compare(start, tp_engine.client.checksums()) and greedy(tp_engine) == reference[0]
    for seed, transport in ((1, BroadcastTransport("127.0.0.1", bucket_mb=0.02)),
                            (2, DiskTransport(tmp_path / "weights"))):
        report = sync(tp_engine, transport, weights(models[0][seed]), retries=0)
        out = tp_engine.client.completions(PROMPTS, max_tokens=8, temperature=0)
        assert report.attempts == 1 and served_tokens(out) == reference[seed]
        assert out["policy_version"] == tp_engine.client.version()
    with pytest.raises(EngineRequestError, match="TP 2 needs broadcast or disk"):
        tp_engine.client.update_ipc([], 1, [], timeout_s=5)
    IpcTransport().close()


def test_a_corrupted_tp_shard_is_caught(tp_engine, tied):
    models, reference = tied[:2], tied[2]
    """The first byte of a column-parallel weight is in row 0: TP rank 0's shard only; rank 1's is intact."""
    name = "model.layers.0.mlp.up_proj.weight"
    before = tp_engine.client.version()
    fault = Fault(name)
    with pytest.raises(SyncVerifyError) as failed:
        sync(tp_engine, BroadcastTransport("127.0.0.1", fault=fault), weights(models[0][1]), retries=0)
    assert name in str(failed.value) and fault.hits == 1
    health = tp_engine.client.health()
    assert health["state"] == "drained" and not health["verified"] and health["version"] == before
    sync(tp_engine, BroadcastTransport("127.0.0.1"), weights(models[0][1]), retries=0)  # sent again
    assert greedy(tp_engine) == reference[1]


def test_a_tied_lm_head_left_on_old_weights_is_caught_and_not_served(tp_engine, tied, tmp_path):
    """A half-applied update for real: vLLM's layerwise reload re-packs a tied embedding once, under its first
    name, and the LM head's own packed GEMM keeps the old weights unless it is re-tied (rollout/vllm_transfer.py
    _retie_lm_head; measured in an RL run). With the re-tie switched off, VERIFY names the tensor (its two served
    copies differ), RESUME is refused; with VERIFY off the same update is served and is neither model."""
    models, reference = tied[:2], tied[2]
    old = next(s for s, toks in reference.items() if toks == greedy(tp_engine))
    new = (old + 1) % len(reference)
    debug = tp_engine.client._post("/collective_rpc", method="rlslurm_debug", args=["1"])["results"]
    assert [str(r) for r in debug] == ["True", "True"]  # both TP workers (vLLM returns results as text)
    try:
        with pytest.raises(SyncVerifyError) as failed:
            sync(tp_engine, DiskTransport(tmp_path / "w"), weights(models[0][new]), retries=0)
        assert "model.embed_tokens.weight" in str(failed.value)
        health = tp_engine.client.health()
        assert health["state"] == "drained" and not health["verified"]
        with pytest.raises(EngineRequestError):
            tp_engine.client.resume(tp_engine.client.version() + 1, timeout_s=10)
        # What VERIFY prevented: served anyway, it is neither the old model nor the new one.
        sync(tp_engine, DiskTransport(tmp_path / "w"), weights(models[0][new]), verify=False)
        served = greedy(tp_engine)
        assert served != reference[new] and served != reference[old]
    finally:
        tp_engine.client._post("/collective_rpc", method="rlslurm_debug", args=["0"])
    sync(tp_engine, DiskTransport(tmp_path / "w"), weights(models[0][new]), retries=0)  # the real update repairs it
    assert greedy(tp_engine) == reference[new]

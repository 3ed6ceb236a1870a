"""Weight sync through vLLM's own RL API, against the real OpenAI server (`vllm serve`, rollout.engine: vllm).

The transformers engine's sync suite (tests/integration/test_sync_transports.py) runs here against one
vLLM server (conftest.py's session `engine`, shared with test_vllm_serving.py): every transport (disk,
broadcast, ipc) goes through /pause,
/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update into vLLM's
workers (rlslurm/rollout/vllm_transfer.py), VERIFY reads what every worker serves, and each response is
stamped with vLLM's weight version. One test differs by design: a vLLM engine keeps no snapshot, so a
failed VERIFY leaves it paused and a sync from the trainer repairs it (instead of a rollback).
"""

from __future__ import annotations

import httpx
import psutil
import pytest

import test_sync_transports as _hf_suite
from rlslurm.rollout.client import EngineRequestError
from rlslurm.sync.checksum import checksums
from rlslurm.sync.config import SyncConfig
from rlslurm.sync.disk import write_weights
from rlslurm.sync.protocol import WeightSync
from rollout_fixtures import PROMPTS, served_tokens, weights
from test_sync_transports import TRANSPORTS, current_seed, fail_a_corrupted_sync, make_transport, sync_to

# The suite's tests, but the rollback one (see the module's docstring): `engine`, `models`, `reference`
# resolve to this module's server and tests/vllm/conftest.py's models.
globals().update({name: test for name, test in vars(_hf_suite).items()
                  if name.startswith("test_") and name != "test_a_tensor_corrupted_in_flight_is_never_served"})

RL_ROUTES = [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/init_weight_transfer_engine"),
             ("POST", "/start_weight_update"), ("POST", "/update_weights"), ("POST", "/finish_weight_update"),
             ("POST", "/update_weight_version"), ("GET", "/weight_info"), ("POST", "/weight_checker"),
             ("POST", "/collective_rpc"), ("POST", "/abort_requests"), ("POST", "/v1/completions"),
             ("GET", "/v1/models"), ("GET", "/metrics")]


def test_every_route_needs_the_secret_and_bodies_are_bounded(engine):
    for method, path in RL_ROUTES:
        r = httpx.request(method, engine.url + path, json={}, timeout=10)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
        wrong = httpx.request(method, engine.url + path, json={}, timeout=10, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401, path
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200  # tells nothing secret
    auth = {"Authorization": f"Bearer {engine.client.token}"}
    assert httpx.get(engine.url + "/is_paused", headers=auth, timeout=10).json() == {"is_paused": False}
    big = httpx.post(engine.url + "/v1/completions", content=b"x" * (2 << 20), headers=auth, timeout=10)
    assert big.status_code == 413
    for bound in ({"n": 17}, {"max_tokens": 65}):
        r = httpx.post(engine.url + "/v1/completions", headers=auth, timeout=10,
                       json={"model": "policy", "prompt": "abc", **bound})
        assert r.status_code == 400 and next(iter(bound)) in r.json()["error"]["message"]


def test_completions_carry_vllm_weight_version_and_logprobs(engine, reference):
    out = engine.client.completions(PROMPTS, max_tokens=8, temperature=0)
    assert out["policy_version"] == engine.client.version()
    assert served_tokens(out) == reference[current_seed(engine, reference)]
    assert all(len(c["token_logprobs"]) == len(c["token_ids"]) for c in out["choices"])


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_corrupted_update_stays_paused_and_a_resend_repairs_it(kind, engine, models, reference, tmp_path):
    _, new_seed, before = fail_a_corrupted_sync(engine, kind, models, reference, tmp_path)
    health = engine.client.health()
    assert health["state"] == "drained" and health["version"] == before and not health["verified"]
    with pytest.raises(EngineRequestError) as refused:
        engine.client.resume(before + 1, timeout_s=10)
    assert refused.value.status == 409

    report = sync_to(engine, kind, new_seed, models, tmp_path)  # the trainer sends again
    out = engine.client.completions(PROMPTS, max_tokens=8, temperature=0)
    assert report.attempts == 1 and out["policy_version"] == before + 1
    assert served_tokens(out) == reference[new_seed]


def test_a_half_applied_update_is_caught_by_name(engine, models, reference, tmp_path):
    """Half of the tensors reach the workers (a real update of the other half never came): VERIFY names
    every tensor still served with the old bytes, RESUME is refused, and the full update then passes.
    (A layer that got some of its tensors may serve none of them: vLLM's layerwise reload applies a layer
    once it is complete, so more than the unsent half can be stale, never less.)"""
    old_seed = current_seed(engine, reference)
    new_seed = (old_seed + 1) % len(reference)
    new, old = weights(models[0][new_seed]), weights(models[0][old_seed])
    sent = dict(list(sorted(new.items()))[::2])
    engine.client.drain(30)
    engine.client.update_disk(str(write_weights(sent, tmp_path / "half", 1)), timeout_s=60)
    answer = engine.client.verify(checksums(new.items()), timeout_s=60)
    stale = sorted(p["name"] for p in answer["mismatches"])
    changed_unsent = {n for n in new if n not in sent and not old[n].equal(new[n])}  # norms start as ones
    assert not answer["ok"] and len(changed_unsent) >= 4 and changed_unsent <= set(stale), stale
    with pytest.raises(EngineRequestError):
        engine.client.resume(engine.client.version() + 1, timeout_s=10)
    version = engine.client.version() + 1
    transport = make_transport("disk", tmp_path)
    WeightSync([engine.client], transport, SyncConfig(timeout_s=60, retries=0)).sync(new, version)
    assert served_tokens(engine.client.completions(PROMPTS, max_tokens=8, temperature=0)) == reference[new_seed]


def _http_bytes(engine) -> float:
    """Bytes of every HTTP request and response body the API server handled so far (vLLM's own counters)."""
    text = httpx.get(engine.url + "/metrics", headers={"Authorization": f"Bearer {engine.client.token}"},
                     timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("http_request_size_bytes_sum", "http_response_size_bytes_sum")))


def _vllm_processes(engine) -> dict[int, str]:
    server = psutil.Process(engine.proc.pid)
    return {p.pid: p.name() for p in [server, *server.children(recursive=True)]}


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_no_weight_bytes_pass_through_the_api_server(kind, engine, models, reference, tmp_path):
    """The weights go from the trainer's socket, file or shared memory into vLLM's worker process: over
    HTTP (vLLM's own request/response size counters) a sync moves under a tenth of its bytes, a broadcast's
    TCP peers are workers only, and the shared-memory buckets are mapped by workers only."""
    vllm = _vllm_processes(engine)
    workers = {pid for pid, name in vllm.items() if name.startswith("VLLM::Worker")}
    assert workers, vllm
    new_seed = (current_seed(engine, reference) + 1) % len(reference)
    tensors = weights(models[0][new_seed])
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    http_before = _http_bytes(engine)
    transport = make_transport(kind, tmp_path)
    try:
        version = engine.client.version() + 1
        WeightSync([engine.client], transport, SyncConfig(timeout_s=60, retries=0)).sync(tensors, version)
        http = _http_bytes(engine) - http_before
        if kind == "broadcast":
            http_port = int(engine.url.rsplit(":", 1)[1])  # our HTTP calls to the API server aside
            ours = {c.raddr.port for c in psutil.Process().net_connections("tcp") if c.raddr} - {http_port}
            peers = {pid for pid in vllm for c in psutil.Process(pid).net_connections("tcp")
                     if c.laddr and c.laddr.port in ours}
            assert peers and peers <= workers, (peers, vllm)
        if kind == "ipc":
            mapped = {pid for pid in vllm for m in psutil.Process(pid).memory_maps() if "/torch_" in m.path}
            assert mapped and mapped <= workers, (mapped, vllm)
    finally:
        transport.close()
    print(f"FIGURE vllm_serve_{kind}_http: {nbytes} weight bytes; {http:.0f} bytes through the API server's HTTP")
    assert http < nbytes / 10, f"the API server's HTTP carried {http} bytes during a sync of {nbytes}"

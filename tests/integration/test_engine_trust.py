"""The engine server's trust boundary, against real server processes on loopback: the job's secret on
every route but /health, no pickle on the IPC route (the RCE payload of issue 15 stays inert), a VERIFY
that needs every served tensor, each request limit a 400 that names it, deadlines, a disconnected
caller's queued work never run, a wedged generation loop seen by /health, and SIGTERM within 5 s."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

import hostile_bodies
from hostile_bodies import HOSTILE, SERVER_FLAGS
from hostile_conns import PeakRSS
from rlslurm.rollout.engine import HFEngine
from rlslurm.rollout.server import EngineServer, build_app
from rlslurm.secret import bearer
from rlslurm.sync.checksum import checksums
from rlslurm.sync.disk import write_weights
from rollout_fixtures import save_model, start_engine, tiny_llama, weights
from waiting import wait_for

LIMITS = ("--max-n", "4", "--max-tokens", "64", "--max-prompts", "3", "--max-batch-rows", "8",
          "--max-prompt-tokens", "120", "--max-body-mb", "0.05")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_model(tiny_llama(0), tmp_path_factory.mktemp("model") / "m0")


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    """Limits small enough to reach; the data plane closed (the default)."""
    proc = start_engine(model, tmp_path_factory.mktemp("logs"), *LIMITS)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def roomy(model, tmp_path_factory):
    """The default body limit (16 MiB): room for a prompt far longer than the model's context (128 tokens)."""
    proc = start_engine(model, tmp_path_factory.mktemp("logs"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def wedged(model, tmp_path_factory):
    """Every generate call first sits 3 s without a step (--debug-stall-s): health says stalled after 1 s,
    a request's deadline is 2 s."""
    proc = start_engine(model, tmp_path_factory.mktemp("logs"), "--debug-stall-s", "3", "--stall-timeout-s", "1",
                        "--request-timeout-s", "2")
    yield proc
    proc.stop()


def http(proc, token: str | None = "right", timeout_s: float = 30) -> httpx.Client:
    """A raw client of `proc`: with its secret ("right"), none (None), or any other string as the token."""
    value = proc.client.token if token == "right" else token
    return httpx.Client(base_url=proc.url, timeout=timeout_s, headers=bearer(value))


def manifest(model_dir: Path) -> list[dict]:
    return [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for n, t in weights(tiny_llama(0)).items()]


# -- the job's secret ------------------------------------------------------------------------------------

def admin_calls(model_dir: Path, tmp_path: Path) -> dict[tuple[str, str], dict | None]:
    """One well-formed call of every admin route (bodies valid for the schema)."""
    shm = {"kind": "shm", "manager": "/tmp/torch-shm-dir-x/manager.sock", "name": "/torch_1_2_3", "nbytes": 64}
    entries = manifest(model_dir)
    return {
        ("GET", "/admin/version"): None,
        ("GET", "/admin/checksum"): None,
        ("POST", "/admin/drain"): {"timeout_s": 10},
        ("POST", "/admin/update/disk"): {"path": str(tmp_path / "nowhere")},
        ("POST", "/admin/broadcast/join"): {"addr": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2,
                                            "timeout_s": 1},
        ("POST", "/admin/update/broadcast"): {"manifest": entries, "bucket_bytes": 1 << 20},
        ("POST", "/admin/update/ipc"): {"manifest": entries, "bucket_bytes": 1 << 30, "handles": [shm]},
        ("POST", "/admin/verify"): {"expected": {}},
        ("POST", "/admin/rollback"): None,
        ("POST", "/admin/resume"): {"version": 0},
    }


def test_the_admin_routes_listed_here_are_all_the_server_has(model, tmp_path):
    app = build_app(EngineServer(HFEngine(model)), "t")
    served = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) if r.path.startswith("/admin/")}
    assert served == set(admin_calls(model, tmp_path))


@pytest.mark.parametrize("token", [None, "wrong-token-of-the-right-length-0123456789abcdef", "Basic"])
def test_every_admin_route_refuses_a_caller_without_the_jobs_secret(engine, model, tmp_path, token):
    client = http(engine, token)
    if token == "Basic":  # the right secret under another scheme is no Bearer token
        client.headers["Authorization"] = f"Basic {engine.client.token}"
    for (method, path), body in admin_calls(model, tmp_path).items():
        r = client.request(method, path, json=body)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        assert r.headers["www-authenticate"] == "Bearer" and set(r.json()) == {"error"}  # nothing else told
    assert engine.client.health()["state"] == "serving"  # none of them drained it


def test_every_admin_route_works_with_the_secret(engine, model, tmp_path):
    client = http(engine)
    answers = {}
    order = ["/admin/version", "/admin/checksum", "/admin/drain", "/admin/update/broadcast",
             "/admin/update/ipc", "/admin/rollback", "/admin/update/disk", "/admin/broadcast/join",
             "/admin/verify", "/admin/rollback", "/admin/resume"]
    calls = {path: (method, body) for (method, path), body in admin_calls(model, tmp_path).items()}
    for path in order:
        method, body = calls[path]
        answers[path] = client.request(method, path, json=body)
        assert answers[path].status_code != 401, (path, answers[path].text)
    assert answers["/admin/version"].json()["version"] == 0
    assert len(answers["/admin/checksum"].json()["checksums"]) == len(weights(tiny_llama(0)))
    assert answers["/admin/drain"].json()["state"] == "drained"
    assert answers["/admin/update/broadcast"].status_code == 409  # no group joined
    assert answers["/admin/update/ipc"].status_code == 400  # the shm segment does not exist
    assert answers["/admin/resume"].json() == {"state": "serving", "version": 0}
    # And a real update through the admin routes, with the secret: drain, disk, verify, resume.
    version = write_weights(weights(tiny_llama(0)), tmp_path / "w", version=1)
    assert client.post("/admin/drain", json={"timeout_s": 10}).status_code == 200
    assert client.post("/admin/update/disk", json={"path": str(version)}).status_code == 200
    assert client.post("/admin/verify", json={"expected": checksums(weights(tiny_llama(0)).items())}).json()["ok"]
    assert client.post("/admin/resume", json={"version": 0}).json()["state"] == "serving"


def test_update_disk_reads_only_regular_files_and_bounded_headers(engine, tmp_path):
    """Issue 37: /admin/update/disk at a version whose files are links to a huge or special file answered 500
    MemoryError (or hung on a FIFO). Each case now is a 400 naming the file, within seconds, and the engine goes
    on serving its verified weights."""
    cases = {}

    def version(name: str) -> Path:
        cases[name] = tmp_path / name
        cases[name].mkdir()
        return cases[name]

    os.mkfifo(version("fifo") / "model.safetensors")
    (version("link") / "model.safetensors").symlink_to("/dev/zero")
    huge = version("huge-header") / "model.safetensors"
    huge.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")  # declares a 1 TiB header
    (version("fifo-index") / "model.safetensors.index.json").symlink_to(cases["fifo"] / "model.safetensors")
    (version("deep-header") / "model.safetensors").write_bytes((20_000).to_bytes(8, "little") + b"[" * 10_000
                                                               + b"]" * 10_000)
    (version("escape") / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../huge-header/model.safetensors"}}))
    said = {"fifo": "a FIFO", "link": "a symbolic link", "huge-header": "a header of 1099511627776 bytes",
            "fifo-index": "a symbolic link", "deep-header": "nested deeper", "escape": "not a plain"}
    client = http(engine, timeout_s=20)
    assert client.post("/admin/drain", json={"timeout_s": 10}).status_code == 200
    try:
        for name, path in cases.items():
            r = client.post("/admin/update/disk", json={"path": str(path)})
            assert r.status_code == 400 and said[name] in r.text, (name, r.status_code, r.text[:300])
    finally:
        assert client.post("/admin/rollback").status_code == 200
        assert client.post("/admin/resume", json={"version": 0}).json()["state"] == "serving"
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200


def test_the_data_plane_needs_the_secret_and_health_tells_nothing_secret(engine):
    body = {"model": "policy", "prompt": "abc", "max_tokens": 2}
    for token in (None, "wrong-token"):
        client = http(engine, token)
        assert client.get("/v1/models").status_code == 401
        assert client.post("/v1/completions", json=body).status_code == 401
    assert http(engine).post("/v1/completions", json=body).status_code == 200
    health = http(engine, None).get("/health")
    assert health.status_code == 200 and "checksum" not in health.text
    assert engine.client.token not in health.text


def test_an_opened_data_plane_serves_anyone_but_admin_stays_closed(model, tmp_path):
    proc = start_engine(model, tmp_path, "--open-data-plane")
    try:
        anyone = http(proc, None)
        assert anyone.get("/v1/models").status_code == 200
        assert anyone.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
        assert anyone.post("/admin/drain", json={"timeout_s": 1}).status_code == 401
        assert anyone.get("/admin/checksum").status_code == 401
    finally:
        proc.stop()


# -- nothing executable crosses the wire ------------------------------------------------------------------

def rce_pickle(command: str) -> bytes:
    """The payload of issue 15: a pickle whose load calls torch.os.system(command), a global the old
    unpickler let through because it lives under the `torch` module."""
    c = command.encode()
    return (b"\x80\x04" + b"\x8c\x05torch\x94" + b"\x8c\x09os.system\x94" + b"\x93"
            + b"\x8c" + bytes([len(c)]) + c + b"\x85" + b"R" + b".")


def test_the_rce_payload_and_any_pickle_are_refused_and_never_run(engine, model, tmp_path):
    marker = tmp_path / "pwned"
    payload = base64.b64encode(rce_pickle(f"touch {marker}")).decode()
    client = http(engine)
    assert client.post("/admin/drain", json={"timeout_s": 10}).status_code == 200
    try:
        entries = manifest(model)
        # The old handle format: {"kind": "cuda", "blob": <base64 pickle>}; with and without the secret.
        old = {"manifest": entries, "bucket_bytes": 1 << 30, "handles": [{"kind": "cuda", "blob": payload}]}
        assert http(engine, None).post("/admin/update/ipc", json=old).status_code == 401
        refused = client.post("/admin/update/ipc", json=old)
        assert refused.status_code == 400 and "invalid request" in refused.json()["error"]["message"], refused.text
        # A pickle smuggled into a well-formed CUDA handle's bytes is only ever bytes: never unpickled.
        smuggled = {"kind": "cuda", "tensor_cls": "Tensor", "storage_cls": "TypedStorage", "dtype": "uint8",
                    "size": [64], "stride": [1], "tensor_offset": 0, "device": 0, "handle": payload,
                    "storage_size_bytes": 64, "storage_offset_bytes": 0, "requires_grad": False,
                    "ref_counter_handle": payload, "ref_counter_offset": 0, "event_handle": payload,
                    "event_sync_required": False}
        assert client.post("/admin/update/ipc", json={**old, "handles": [smuggled]}).status_code == 400
        # A class outside the allow-list, and a shared-memory name that is a path, are off the schema.
        for handle in ({**smuggled, "tensor_cls": "os.system"}, {**smuggled, "dtype": "object"},
                       {"kind": "shm", "manager": "/tmp/x/manager.sock", "name": "/etc/shadow", "nbytes": 8}):
            assert client.post("/admin/update/ipc", json={**old, "handles": [handle]}).status_code == 400
        time.sleep(0.5)
        assert not marker.exists()
    finally:
        client.post("/admin/rollback")
        assert client.post("/admin/resume", json={"version": 0}).status_code == 200


# -- VERIFY ----------------------------------------------------------------------------------------------

def test_verify_refuses_an_empty_or_partial_expectation(engine, tmp_path):
    client = http(engine)
    sent = weights(tiny_llama(0))
    expected = checksums(sent.items())
    assert client.post("/admin/drain", json={"timeout_s": 10}).status_code == 200
    path = write_weights(sent, tmp_path, version=1)
    assert client.post("/admin/update/disk", json={"path": str(path)}).status_code == 200

    empty = client.post("/admin/verify", json={"expected": {}}).json()
    assert not empty["ok"] and empty["missing"] == len(sent)
    partial = dict(expected)
    left_out = partial.pop("lm_head.weight")
    verdict = client.post("/admin/verify", json={"expected": partial}).json()
    assert not verdict["ok"] and verdict["missing"] == 1
    assert [m["name"] for m in verdict["mismatches"]] == ["lm_head.weight"] and left_out
    refused = client.post("/admin/resume", json={"version": 0})
    assert refused.status_code == 409 and "not verified" in refused.text

    assert client.post("/admin/verify", json={"expected": expected}).json()["ok"]
    assert client.post("/admin/resume", json={"version": 0}).status_code == 200


# -- bounded work ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, named", [
    ({"prompt": "abc", "n": 1_000_000}, "max_n = 4"),
    ({"prompt": "abc", "n": 5}, "max_n = 4"),
    ({"prompt": "abc", "max_tokens": 65}, "rollout.max_new_tokens"),
    ({"prompt": ["a", "b", "c", "d"]}, "max_prompts_per_request = 3"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "max_batch_rows = 8"),
    ({"prompt": "a" * 121}, "max_prompt_tokens = 120"),
    ({"prompt": "a" * 100, "max_tokens": 64}, "context of 128 tokens (max_position_embeddings)"),
    ({"prompt": [1, 2, 46]}, "token id 46 is outside the vocabulary [0, 46)"),
    ({"prompt": [[5, 6], [-1]]}, "token id -1 is outside the vocabulary"),
    ({"prompt": "abc", "top_p": 0.5}, "top_p: Extra inputs are not permitted"),
    ({"prompt": "abc", "n": "many"}, "n: Value error, a count must be a whole number, not a string"),
    ({"prompt": ""}, "prompt 0 encodes to zero tokens"),
])
def test_each_request_bound_is_a_400_that_names_it(engine, body, named):
    started = time.monotonic()
    r = http(engine).post("/v1/completions", json={"model": "policy", **body})
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"], r.json()
    assert time.monotonic() - started < 5  # refused up front, not after generating


@pytest.mark.parametrize("fragment, named", HOSTILE, ids=[f for f, _ in HOSTILE])
def test_hostile_numbers_in_every_json_type_are_a_400(engine, fragment, named):
    """The table vLLM's gate is held to (tests/vllm/test_vllm_bounds.py): a count by value, whatever its type."""
    assert LIMITS[:8] == SERVER_FLAGS  # the same limits as the vLLM server the table also runs against
    r = http(engine).post("/v1/completions", content=hostile_bodies.body(fragment),
                          headers={"content-type": "application/json"})
    assert r.status_code == 400, (fragment, r.status_code, r.text[:300])
    assert named in r.json()["error"]["message"], (fragment, r.json())


@pytest.mark.parametrize("hostile, named", [
    (b'{"prompt": "abc", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "nested deeper"),
    (b'{"prompt": "abc", "max_tokens": ' + b"9" * 20_000 + b"}", "digits"),
])
def test_hostile_json_is_a_400_that_says_why(roomy, hostile, named):
    r = http(roomy).post("/v1/completions", content=hostile, headers={"content-type": "application/json"})
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text[:300]


def test_an_integral_float_within_bounds_is_served(engine):
    r = http(engine).post("/v1/completions", json={"prompt": "abc", "n": 2.0, "max_tokens": 3.0, "logprobs": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_a_body_past_its_limit_is_413_declared_or_streamed(engine):
    big = {"prompt": "a" * 60_000}
    assert http(engine).post("/v1/completions", json=big).status_code == 413

    def chunks():
        for _ in range(100):
            yield b" " * 1024
    streamed = http(engine).post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert http(engine, None).post("/v1/completions", json=big).status_code == 401  # auth first, body unread


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(roomy):
    """Issue 37: the engine tokenized a whole prompt before it compared it with the context (one 15 MiB prompt:
    37 s and +4.1 GB). A 6 MiB one now is refused by its bytes, in milliseconds, and the server grows by little
    more than the body it read; a prompt near the bound is still tokenized and measured in tokens."""
    with PeakRSS(roomy.proc.pid) as memory:
        started = time.monotonic()
        r = http(roomy).post("/v1/completions", json={"prompt": "a" * (6 << 20), "max_tokens": 2})
        took = time.monotonic() - started
    print(f"FIGURE long_prompt_hf: a 6 MiB prompt refused in {took * 1000:.0f} ms, RSS {memory.base_mib:.0f} -> "
          f"peak {memory.peak_mib:.0f} MiB (+{memory.growth_mib:.0f}), load {os.getloadavg()[0]:.2f}")
    assert r.status_code == 400 and "refused before tokenizing" in r.text and "6.3 MB" in r.text, r.text[:300]
    assert took < 5 and memory.growth_mib < 200, (took, memory.growth_mib)
    near = http(roomy).post("/v1/completions", json={"prompt": "a" * 200, "max_tokens": 2})
    assert near.status_code == 400 and "over the model's context of 128 tokens" in near.text, near.text[:300]
    assert http(roomy).post("/v1/completions", json={"prompt": "a" * 100, "max_tokens": 2}).status_code == 200


def _post_in_thread(proc, body: dict, out: list, timeout_s: float = 60) -> threading.Thread:
    def post():
        try:
            out.append(http(proc, timeout_s=timeout_s).post("/v1/completions", json=body))
        except httpx.HTTPError as e:
            out.append(e)
    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_a_wedged_generation_loop_turns_health_unhealthy_and_a_deadline_gives_504(wedged):
    assert http(wedged, None).get("/health").status_code == 200
    time.sleep(1.5)  # idle for longer than the stall timeout: idle is not wedged
    assert http(wedged, None).get("/health").status_code == 200
    out: list = []
    started = time.monotonic()
    thread = _post_in_thread(wedged, {"prompt": "abc", "max_tokens": 4}, out)
    sick = wait_for("/health to say unhealthy", lambda: (lambda r: r if r.status_code == 503 else None)(
        http(wedged, None).get("/health")), timeout_s=10)
    assert "no progress" in sick.json()["reason"] and sick.json()["status"] == "unhealthy"
    thread.join(30)
    (answer,) = out
    assert answer.status_code == 504 and "deadline" in answer.json()["error"]["message"]
    assert 1.5 < time.monotonic() - started < 4  # at the deadline (2 s), not after the stall
    healthy = wait_for("/health to recover", lambda: (lambda r: r if r.status_code == 200 else None)(
        http(wedged, None).get("/health")), timeout_s=10)
    assert healthy.json()["pending"] == 0 and healthy.json()["dropped"]["deadline"] >= 1


def test_a_disconnected_clients_queued_work_never_runs(wedged):
    before = http(wedged, None).get("/health").json()
    out: list = []
    first = _post_in_thread(wedged, {"prompt": "abc", "max_tokens": 4}, out)
    wait_for("the first request to run", lambda: http(wedged, None).get("/health").json()["batches"]
             > before["batches"], timeout_s=10)
    with pytest.raises(httpx.ReadTimeout):  # the caller gives up and closes its connection
        http(wedged, timeout_s=0.5).post("/v1/completions", json={"prompt": "xyz", "max_tokens": 4,
                                                                   "temperature": 0})
    after = wait_for("the disconnect to be seen", lambda: (lambda h: h if h["dropped"]["disconnected"]
                     > before["dropped"]["disconnected"] else None)(http(wedged, None).get("/health").json()))
    first.join(30)
    settled = wait_for("the engine to settle", lambda: (lambda h: h if h["pending"] == 0 else None)(
        http(wedged, None).get("/health").json()), timeout_s=10)
    assert settled["batches"] == before["batches"] + 1, (before, after, settled)  # the second never ran


def test_sigterm_ends_an_engine_within_5_s_with_a_request_in_flight(tmp_path):
    model = save_model(tiny_llama(0, context=4096), tmp_path / "long", eos=False)  # every sample runs 4000 tokens
    proc = start_engine(model, tmp_path, "--max-tokens", "4000", "--max-n", "16")
    out: list = []
    try:
        thread = _post_in_thread(proc, {"prompt": "abc", "n": 16, "max_tokens": 4000, "temperature": 1.0}, out)
        wait_for("the generation to be under way", lambda: proc.client.health()["steps"] > 20, timeout_s=60)
        assert not out, "the generation finished too soon to test a stop in the middle of it"
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        proc.proc.wait(30)
        stopped_s = time.monotonic() - started
        thread.join(10)
    finally:
        proc.stop()
    print(f"FIGURE sigterm_hf: the engine exited {stopped_s:.2f} s after SIGTERM, 16 x 4000 tokens in flight")
    assert stopped_s < 5, f"SIGTERM took {stopped_s:.1f} s"
    (answer,) = out
    assert isinstance(answer, httpx.HTTPError) or answer.status_code == 503, answer

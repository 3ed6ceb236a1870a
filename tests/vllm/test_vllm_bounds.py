"""vLLM's server behind rlslurm's gate (rollout/vllm_serve.py SecretGate), issue 29: the job's bounds by value on
every route that generates or tokenizes, whatever the JSON type (hostile_bodies.py's table, which the transformers
engine passes too: test_engine_trust.py), with or without the secret on an open data plane; those routes take the
data body limit; a route the gate does not know is refused even with the secret (default deny), and the routes
vLLM mounted are listed by the gate at startup. One server (rollout.open_data_plane true), started once."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from hostile_bodies import HOSTILE, LIMITS, body, chat_body
from rlslurm.rollout.vllm_serve import ADMIN_PATHS, DATA_ROUTES
from rlslurm.secret import bearer
from rollout_fixtures import save_model, tiny_llama
from vllm_fixtures import start_vllm_serve

BODY_LIMIT = 50_000
JSON = {"content-type": "application/json"}
GENERATING = ("/v1/completions", "/invocations")
REFUSED = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions/batch",
           "/inference/v1/generate", "/generative_scoring", "/v1/completions/render", "/v1/chat/completions/render",
           "/v1/completions/derender", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/classify",
           "/v1/embeddings", "/sleep", "/wake_up", "/reset_prefix_cache", "/scale_elastic_ep", "/server_info",
           "/version", "/load", "/ping", "/docs", "/openapi.json", "/v1/completions/", "/V1/completions",
           "/v1//completions", "/metrics/", "/no/such/route")


@pytest.fixture(scope="module")
def open_engine(vllm_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-bounds")
    model = save_model(tiny_llama(0, hidden=128), root / "m")
    proc = start_vllm_serve(model, root, vllm_python,
                            limits={**LIMITS, "max_body_bytes": BODY_LIMIT, "open_data": True})
    yield proc
    proc.stop(timeout_s=30)


def post(engine, path: str, content: bytes, secret: bool) -> httpx.Response:
    headers = {**JSON, **(bearer(engine.client.token) if secret else {})}
    return httpx.post(engine.url + path, content=content, headers=headers, timeout=60)


def test_hostile_numbers_are_refused_on_every_generating_route_with_or_without_the_secret(open_engine):
    wrong = []
    for path in GENERATING:
        for fragment, named in HOSTILE:
            for secret in (False, True):
                r = post(open_engine, path, body(fragment), secret)
                if r.status_code != 400 or named not in r.json()["error"]["message"]:
                    wrong.append((path, fragment, secret, r.status_code, r.text[:160]))
    for fragment, _named in HOSTILE:
        if '"prompt"' in fragment:
            continue  # a chat body has messages, not prompts
        for path in ("/v1/chat/completions", "/invocations"):
            r = post(open_engine, path, chat_body(fragment.replace("logprobs", "top_logprobs")
                                                    if fragment.startswith('"logprobs"') else fragment), False)
            if r.status_code != 400:
                wrong.append((path, "chat", fragment, r.status_code, r.text[:160]))
    assert not wrong, "\n".join(map(str, wrong))


def test_a_chat_request_must_name_its_max_tokens(open_engine):
    chat = b'{"model": "policy", "messages": [{"role": "user", "content": "abc"}]}'
    for path in ("/v1/chat/completions", "/invocations"):
        r = post(open_engine, path, chat, False)
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text


def test_within_bounds_integral_floats_are_served_on_every_generating_route(open_engine):
    for path in GENERATING:
        r = post(open_engine, path, b'{"model": "policy", "prompt": "abc", "n": 2.0, "max_tokens": 3.0}', False)
        assert r.status_code == 200, (path, r.text[:300])
        choices = r.json()["choices"]
        assert len(choices) == 2 and all(len(c["token_ids"] or []) <= 3 for c in choices), choices
    tokens = post(open_engine, "/tokenize", b'{"model": "policy", "prompt": "abc"}', False)
    assert tokens.status_code == 200 and tokens.json()["tokens"], tokens.text


def test_tokenizing_routes_take_the_data_body_limit(open_engine):
    big = json.dumps({"model": "policy", "prompt": "a" * (5 << 20)}).encode()
    for path in ("/tokenize", "/detokenize", "/invocations", "/v1/chat/completions", "/v1/completions"):
        for secret in (False, True):
            r = post(open_engine, path, big, secret)
            assert r.status_code == 413 and str(BODY_LIMIT) in r.text, (path, secret, r.status_code, r.text[:200])


def test_a_route_the_gate_does_not_know_is_refused_even_with_the_secret(open_engine):
    for path in REFUSED:
        for method in ("GET", "POST"):
            anyone = httpx.request(method, open_engine.url + path, json={}, timeout=30)
            assert anyone.status_code == 401, (method, path, anyone.status_code, anyone.text[:200])
            holder = httpx.request(method, open_engine.url + path, json={}, timeout=30,
                                   headers=bearer(open_engine.client.token))
            assert holder.status_code == 403, (method, path, holder.status_code, holder.text[:200])
    for path in ADMIN_PATHS:  # an open data plane leaves the weight-sync routes closed
        assert httpx.post(open_engine.url + path, json={}, timeout=30).status_code == 401, path
    assert httpx.get(open_engine.url + "/is_paused", headers=bearer(open_engine.client.token),
                     timeout=30).json() == {"is_paused": False}


def test_a_websocket_is_refused_even_with_the_secret(open_engine):
    import socket

    host, port = open_engine.url.removeprefix("http://").split(":")
    for path in ("/v1/realtime", "/v1/completions"):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                          f"Authorization: Bearer {open_engine.client.token}\r\n\r\n").encode())
            status = sock.recv(1024).split(b"\r\n", 1)[0]
        assert b" 101 " not in status and status, (path, status)


def test_the_gate_lists_every_route_vllm_mounted_and_passes_only_its_own(open_engine):
    line = re.search(r"rlslurm gate routes: (\{.*\})", open_engine.log_path.read_text())
    assert line, "the gate logs vLLM's routes at startup"
    kinds = json.loads(line.group(1))
    print(f"FIGURE vllm_routes: {json.dumps(kinds)}")
    assert set(kinds["data"]) == set(DATA_ROUTES), kinds  # every data route the gate bounds is vLLM's
    assert set(kinds["admin"]) == set(ADMIN_PATHS), kinds
    assert set(kinds["open"]) == {"/health", *DATA_ROUTES}  # an open data plane
    for path in ("/v1/responses", "/inference/v1/generate", "/collective_rpc", "/sleep", "/docs", "/ping"):
        assert (path in kinds["refused"]) == (path not in ADMIN_PATHS), path

"""vLLM's server behind rlslurm's gate (rollout/vllm_serve.py SecretGate), issue 29: the job's bounds by value on
every route that generates or tokenizes, whatever the JSON type (hostile_bodies.py's table, which the transformers
engine passes too: test_engine_trust.py), with or without the secret on an open data plane; those routes take the
data body limit; a route the gate does not know is refused even with the secret (default deny), and the routes
vLLM mounted are listed by the gate at startup. Issue 37: /invocations is bounded as every kind of body vLLM may
serve it as (its completion fallback included); nesting and integers past safejson's bounds are a 400, not vLLM's
500; a stranger's 60 MiB bodies leave the API server's memory flat and its trickled heads are closed by their
deadline (rlslurm/connguard.py, through rollout/vllm_api.py). One server (rollout.open_data_plane true), started
once."""

from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest

from hostile_bodies import HOSTILE, LIMITS, body, chat_body
from hostile_conns import Trickle, big_bodies, endless_head
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


def test_invocations_is_bounded_as_every_kind_vllm_may_serve_it_as(open_engine):
    """The body of issue 37 at this engine's limits: `messages` that are no chat (vLLM's /invocations then serves
    it as a completion) beside 4 prompts; the old gate bounded it as one chat prompt and vLLM returned 8 choices."""
    hostile = json.dumps({"model": "policy", "messages": "x", "prompt": [[5, 6]] * 4, "n": 2, "max_tokens": 2})
    for path in ("/invocations", "/v1/completions"):
        for secret in (False, True):
            r = post(open_engine, path, hostile.encode(), secret)
            assert r.status_code == 400 and "4 prompts" in r.json()["error"]["message"], (path, r.text[:300])
    fits = json.dumps({"model": "policy", "messages": "x", "prompt": [[5, 6]] * 2, "n": 2, "max_tokens": 2})
    served = post(open_engine, "/invocations", fits.encode(), False)
    assert served.status_code == 200 and len(served.json()["choices"]) == 4, served.text[:300]


def test_deep_nesting_and_huge_integers_are_a_400_on_every_data_route(open_engine):
    deep = b'{"model": "policy", "prompt": "abc", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    digits = b'{"model": "policy", "prompt": "abc", "max_tokens": ' + b"9" * 30_000 + b"}"
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations", "/tokenize"):
        for hostile, named in ((deep, "nested deeper"), (digits, "digits")):
            r = post(open_engine, path, hostile, True)
            assert r.status_code == 400 and named in r.text, (path, named, r.status_code, r.text[:200])
    assert httpx.get(open_engine.url + "/health", timeout=30).status_code == 200


def test_a_strangers_big_bodies_leave_the_api_server_flat_and_its_trickles_are_closed(open_engine):
    """20 callers without the secret, 60 MiB each, chunked, to /health, a data route and an admin route (the old
    gate buffered /health's up to 64 MiB: +1.18 GB); then 80 connections trickling a head: the job's calls are
    answered meanwhile, and every trickle is closed by its deadline (old: held for as long as it trickled)."""
    attack = big_bodies(open_engine.url, open_engine.proc.pid, ["/health", "/v1/completions", "/update_weights"],
                        count=20, mib=60)
    with Trickle(open_engine.url, 80, interval_s=1.0, time_s=30) as strangers:
        time.sleep(1.5)
        answered = []
        for _ in range(5):
            started = time.monotonic()
            r = httpx.post(open_engine.url + "/v1/completions", headers=bearer(open_engine.client.token), timeout=60,
                           json={"model": "policy", "prompt": "abc", "max_tokens": 2})
            assert r.status_code == 200, r.text[:200]
            answered.append(time.monotonic() - started)
        started = time.monotonic()
        while strangers.closed() < strangers.count and time.monotonic() - started < 20:
            time.sleep(0.25)
        shut, shut_s = strangers.closed(), time.monotonic() - strangers.opened_at
    print(f"FIGURE vllm_pre_auth: 20 x 60 MiB chunked bodies without the secret in {attack['seconds']:.1f} s: "
          f"API server RSS {attack['base_mib']:.0f} -> peak {attack['peak_mib']:.0f} MiB "
          f"(+{attack['growth_mib']:.0f}); 80 trickling heads: the job's calls answered in "
          f"{max(answered) * 1000:.0f} ms at most, {shut} trickles shut after {shut_s:.1f} s, "
          f"load {os.getloadavg()[0]:.2f}")
    assert attack["growth_mib"] < 64, attack
    assert shut == strangers.count, f"{shut} of {strangers.count} trickled heads closed"


def test_a_head_that_never_ends_is_closed_past_its_size_bound(open_engine):
    """vLLM's protocol (uvicorn's httptools) kept every header line of an unfinished head: 200 MiB of them grew
    a server by 196 MiB. The guard closes the connection past its 16 KiB."""
    sent = endless_head(open_engine.url, open_engine.proc.pid, mib=32)
    assert sent["shut"] and sent["sent_mib"] < 8 and sent["growth_mib"] < 16, sent

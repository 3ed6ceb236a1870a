"""Connections before the job's secret (issue 37, rlslurm/connguard.py and rlslurm/wire.py), against the real
transformers engine and reward service processes on loopback: a stranger's 60 MiB bodies leave each server's
memory flat; heads trickled a byte a second are closed by their deadline while the job's calls are answered;
a stranger holding every unproven slot is pushed out by the job's new connections; an open route reads no body;
a body trickled past its deadline is a 408. vLLM's API server is held to the same, and to the bound on a head's
size that its HTTP parser lacks, in tests/vllm/test_vllm_bounds.py."""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest

from hostile_conns import Trickle, big_bodies
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.supervisor import RewardSupervisor
from rlslurm.secret import bearer
from rollout_fixtures import save_model, start_engine, tiny_llama

HEAD_TIMEOUT_S = 10.0  # connguard.Policy's default, which both servers run with


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard-engine")
    proc = start_engine(save_model(tiny_llama(0), root / "m"), root)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def open_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard-open")
    proc = start_engine(save_model(tiny_llama(0), root / "m"), root, "--open-data-plane")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    cfg = RewardConfig(scorer="rule", concurrency=4, timeout_s=10.0, health_interval_s=0.5)
    with RewardSupervisor(cfg, log_dir=tmp_path_factory.mktemp("guard-reward")) as sup:
        yield sup


def servers(engine, reward) -> dict:
    """name -> (url, pid, the job's call, paths a stranger's bodies go to)."""
    return {
        "engine": (engine.url, engine.proc.pid,
                   lambda c: c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}),
                   ["/health", "/v1/completions", "/admin/update/disk"]),
        "reward": (reward.url, reward.proc.pid,
                   lambda c: c.post("/score", json={"items": [{"id": "0", "response": "19", "reference": "19"}]}),
                   ["/health", "/score", "/metrics"]),
    }


def token_of(name: str, engine, reward) -> str:
    return engine.client.token if name == "engine" else reward.token


@pytest.mark.parametrize("name", ["engine", "reward"])
def test_a_strangers_big_bodies_leave_the_server_flat(name, engine, reward):
    """20 callers without the secret, 60 MiB each, chunked: the old gate buffered /health's body to its limit
    (16 MiB on the engine; +101 MiB RSS measured), now an open route reads none and every refused caller's rest
    is dropped as it arrives."""
    url, pid, call, paths = servers(engine, reward)[name]
    attack = big_bodies(url, pid, paths, count=20, mib=60)
    print(f"FIGURE pre_auth_{name}: 20 x 60 MiB chunked bodies without the secret to {paths} in "
          f"{attack['seconds']:.1f} s: RSS {attack['base_mib']:.0f} -> peak {attack['peak_mib']:.0f} MiB "
          f"(+{attack['growth_mib']:.0f}), load {os.getloadavg()[0]:.2f}")
    assert attack["growth_mib"] < 32, attack
    with httpx.Client(base_url=url, timeout=30, headers=bearer(token_of(name, engine, reward))) as client:
        assert call(client).status_code == 200


@pytest.mark.parametrize("name", ["engine", "reward"])
def test_trickled_heads_are_closed_by_their_deadline_while_the_jobs_calls_are_answered(name, engine, reward):
    """80 connections (past the 64 unproven a server holds) trickling a head a byte a second: the job's new
    connections take the oldest ones' places and are answered at once; every trickle is closed within its
    head deadline (old: held as long as it trickled)."""
    url, _pid, call, _paths = servers(engine, reward)[name]
    with Trickle(url, 80, interval_s=1.0, time_s=HEAD_TIMEOUT_S + 15) as strangers:
        time.sleep(1.5)  # past the grace a young unproven connection has
        answered = []
        for _ in range(10):
            started = time.monotonic()
            with httpx.Client(base_url=url, timeout=30, headers=bearer(token_of(name, engine, reward))) as client:
                assert call(client).status_code == 200
            answered.append(time.monotonic() - started)
        started = time.monotonic()
        while strangers.closed() < strangers.count and time.monotonic() - started < HEAD_TIMEOUT_S + 8:
            time.sleep(0.25)
        shut, shut_s = strangers.closed(), time.monotonic() - strangers.opened_at
    print(f"FIGURE trickle_{name}: 80 trickling heads; 10 job calls on new connections answered in "
          f"{max(answered) * 1000:.0f} ms at most; {shut} trickles shut {shut_s:.1f} s after they opened, "
          f"load {os.getloadavg()[0]:.2f}")
    assert max(answered) < 5.0, answered
    assert shut == strangers.count, f"{shut} of {strangers.count} trickled heads closed"


def test_an_open_route_reads_no_body_and_a_caller_without_the_secret_gets_one_answer(engine):
    declared = httpx.post(engine.url + "/health", content=b"x" * 1000, timeout=30)
    assert declared.status_code == 413 and "reads no request body" in declared.text
    anyone = httpx.Client(base_url=engine.url, timeout=30)
    health = anyone.get("/health")
    assert health.status_code == 200 and health.headers["connection"] == "close"
    assert anyone.get("/health").status_code == 200  # the client opens a new connection, as told
    job = httpx.Client(base_url=engine.url, timeout=30, headers=bearer(engine.client.token))
    assert "connection" not in job.get("/health").headers  # the job's connection is kept alive


def test_a_body_that_trickles_past_its_deadline_is_refused(engine):
    """A caller with the secret whose body does not finish within wire.BODY_TIMEOUT_S (30 s) gets a 408 at
    that deadline, not a read that waits for as long as the body trickles."""
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {engine.client.token}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
        started = time.monotonic()
        sock.settimeout(1.0)
        answer = b""
        while time.monotonic() - started < 45 and b"\r\n\r\n" not in answer:
            try:
                sock.sendall(b" ")  # a byte a second: never done within 100 bytes' worth of deadline
                answer += sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 25 < waited < 40, waited



def test_an_open_data_plane_reads_a_bounded_number_of_strangers_bodies_at_once(open_engine):
    """rollout.open_data_plane serves callers without the secret, MAX_OPEN_REQUESTS (16) at a time: 16 bodies that
    never finish hold the slots (until their 30 s deadline), the 17th caller is told 503 with Retry-After, the
    job's own calls are not counted; once the 16 leave, a stranger is served again."""
    from rlslurm.wire import MAX_OPEN_REQUESTS

    host, port = open_engine.url.removeprefix("http://").split(":")
    holders = []
    try:
        for _ in range(MAX_OPEN_REQUESTS):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            holders.append(sock)
        time.sleep(1.0)  # their heads are read and their bodies awaited
        body = {"prompt": "abc", "max_tokens": 2}
        turned = httpx.post(open_engine.url + "/v1/completions", json=body, timeout=30)
        assert turned.status_code == 503 and turned.headers["retry-after"] == "1", turned.text
        assert f"{MAX_OPEN_REQUESTS} requests without the job's secret" in turned.json()["error"]["message"]
        job = httpx.post(open_engine.url + "/v1/completions", json=body, timeout=30,
                         headers=bearer(open_engine.client.token))
        assert job.status_code == 200, job.text
    finally:
        for sock in holders:
            sock.close()
    time.sleep(1.0)
    assert httpx.post(open_engine.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2},
                      timeout=30).status_code == 200

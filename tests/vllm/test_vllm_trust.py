"""The vLLM engine server's bounded work: a caller that disconnects mid-generation has its requests
aborted inside vLLM (not generated to the end), the admin routes need the job's secret, and SIGTERM with
a long generation in flight ends the server and vLLM's engine processes within 5 s."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from rlslurm.secret import bearer
from rollout_fixtures import save_model, tiny_llama
from vllm_fixtures import start_vllm
from waiting import wait_for

LONG = {"prompt": "abc", "n": 64, "max_tokens": 4000, "temperature": 1.0}
"""64 x 4000 tokens (the model has no end-of-sequence token) with attention over up to 4096 positions:
minutes on a CPU, were it not stopped."""


@pytest.fixture(scope="module")
def long_engine(vllm_python, tmp_path_factory):
    """A vLLM engine on a model with a 4096-token context: a generation that takes long enough to stop."""
    model = save_model(tiny_llama(0, hidden=128, layers=4, context=4096), tmp_path_factory.mktemp("long") / "m",
                       eos=False)
    proc = start_vllm(model, tmp_path_factory.mktemp("vllm-trust-logs"), vllm_python, "--max-tokens", "4000")
    yield proc
    proc.stop(timeout_s=30)


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def health(proc) -> dict:
    return httpx.get(proc.url + "/health", timeout=10).json()


def test_admin_routes_need_the_secret(long_engine):
    assert httpx.get(long_engine.url + "/admin/checksum", timeout=10).status_code == 401
    assert httpx.post(long_engine.url + "/admin/drain", json={"timeout_s": 1}, timeout=10).status_code == 401
    assert long_engine.client.checksums()  # with it


def test_a_disconnected_caller_is_aborted_inside_vllm(long_engine):
    before = health(long_engine)
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(long_engine.url + "/v1/completions", json=LONG, timeout=2.0,
                   headers=bearer(long_engine.client.token))
    settled = wait_for("the aborted generation to end", lambda: (lambda h: h if h["pending"] == 0 else None)(
        health(long_engine)), timeout_s=30)
    assert settled["dropped"]["disconnected"] == before["dropped"]["disconnected"] + 1
    # A whole generation of 64 x 4000 tokens takes far longer than this on a CPU.
    assert time.monotonic() - started < 8
    assert long_engine.client.completions(["abc"], max_tokens=4)["choices"]  # and it serves on


def test_sigterm_ends_the_vllm_engine_within_5_s_with_a_request_in_flight(long_engine):
    children = psutil.Process(long_engine.proc.pid).children(recursive=True)
    assert children, "vLLM's engine core runs in a child process"
    out: list = []

    def post():
        try:
            out.append(httpx.post(long_engine.url + "/v1/completions", json=LONG, timeout=60,
                                  headers=bearer(long_engine.client.token)))
        except httpx.HTTPError as e:
            out.append(e)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    steps = health(long_engine)["steps"]
    wait_for("the generation to be under way", lambda: health(long_engine)["steps"] > steps + 20, timeout_s=60)
    assert not out, "the generation finished too soon to test a stop in the middle of it"
    started = time.monotonic()
    long_engine.proc.send_signal(signal.SIGTERM)
    long_engine.proc.wait(30)
    alive = children
    while alive and time.monotonic() - started < 5:  # a zombie is gone: the container's init may not reap it
        alive = [c for c in alive if running(c)]
        time.sleep(0.05)
    stopped_s = time.monotonic() - started
    thread.join(10)
    print(f"FIGURE sigterm_vllm: server and vLLM processes gone {stopped_s:.2f} s after SIGTERM, 64 x 4000 in flight")
    assert stopped_s < 5 and not alive, f"SIGTERM took {stopped_s:.1f} s; still alive: {alive}"
    (answer,) = out
    assert isinstance(answer, httpx.HTTPError) or answer.status_code == 503, answer

"""vLLM's own server's bounded work: a caller that disconnects mid-generation has its requests aborted inside
vLLM (not generated to the end), and SIGTERM with a long generation in flight ends the server and vLLM's
engine processes within 5 s. (Every route needing the job's secret: test_vllm_serve_sync.py.)"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from rlslurm.rollout.vllm_metrics import GENERATED, RUNNING, WAITING, total
from rlslurm.secret import bearer
from rollout_fixtures import save_model, tiny_llama
from vllm_fixtures import start_vllm_serve
from waiting import wait_for

LONG = {"model": "policy", "prompt": "abc", "n": 64, "max_tokens": 4000, "temperature": 1.0}
"""64 x 4000 tokens (the model has no end-of-sequence token) with attention over up to 4096 positions:
minutes on a CPU, were it not stopped."""


@pytest.fixture(scope="module")
def long_engine(vllm_python, tmp_path_factory):
    """A vLLM server on a model with a 4096-token context: a generation that takes long enough to stop."""
    model = save_model(tiny_llama(0, hidden=128, layers=4, context=4096), tmp_path_factory.mktemp("long") / "m",
                       eos=False)
    proc = start_vllm_serve(model, tmp_path_factory.mktemp("vllm-trust-logs"), vllm_python,
                            limits={"max_n": 64, "max_tokens": 4000})
    yield proc
    proc.stop(timeout_s=30)


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def counters(engine) -> tuple[float, float]:
    """(requests running + waiting, tokens generated so far): vLLM's own /metrics."""
    samples = engine.client.metrics()
    return total(samples, RUNNING) + total(samples, WAITING), total(samples, GENERATED)


def test_a_disconnected_caller_is_aborted_inside_vllm(long_engine):
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(long_engine.url + "/v1/completions", json=LONG, timeout=2.0,
                   headers=bearer(long_engine.client.token))
    wait_for("the aborted generation to leave vLLM's scheduler", lambda: counters(long_engine)[0] == 0, timeout_s=30)
    # A whole generation of 64 x 4000 tokens takes far longer than this on a CPU.
    assert time.monotonic() - started < 8
    _, generated = counters(long_engine)
    assert generated < 64 * 4000 / 4, generated
    assert long_engine.client.completions(["abc"], max_tokens=4)["choices"]  # and it serves on


def post_long(engine, out: list) -> threading.Thread:
    """One 64 x 4000 generation in a thread; its answer (or error) lands in `out`."""
    def post():
        try:
            out.append(httpx.post(engine.url + "/v1/completions", json=LONG, timeout=60,
                                  headers=bearer(engine.client.token)))
        except httpx.HTTPError as e:
            out.append(e)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    generated = counters(engine)[1]
    wait_for("the generation to be under way", lambda: counters(engine)[1] > generated + 64 * 20, timeout_s=60)
    assert not out, "the generation finished too soon to test a stop in the middle of it"
    return thread


def test_sigterm_ends_the_vllm_server_within_5_s_with_a_request_in_flight(long_engine):
    children = psutil.Process(long_engine.proc.pid).children(recursive=True)
    assert children, "vLLM's engine core runs in a child process"
    out: list = []
    thread = post_long(long_engine, out)
    started = time.monotonic()
    long_engine.proc.send_signal(signal.SIGTERM)
    long_engine.proc.wait(30)
    alive = children
    while alive and time.monotonic() - started < 5:  # a zombie is gone: the container's init may not reap it
        alive = [c for c in alive if running(c)]
        time.sleep(0.05)
    stopped_s = time.monotonic() - started
    thread.join(10)
    print(f"FIGURE sigterm_vllm_serve: server and vLLM processes gone {stopped_s:.2f} s after SIGTERM, "
          "64 x 4000 in flight")
    assert stopped_s < 5 and not alive, f"SIGTERM took {stopped_s:.1f} s; still alive: {alive}"
    (answer,) = out
    # An error, or vLLM's own answer with every sample marked aborted (the EngineCore's abort can reach the
    # caller before the gate ends the request); rlslurm's client refuses the latter (rollout/vllm_client.py).
    if not isinstance(answer, httpx.HTTPError) and answer.status_code == 200:
        reasons = {c["finish_reason"] for c in answer.json()["choices"]}
        assert reasons == {"abort"}, (reasons, answer.text[:600])
    else:
        assert isinstance(answer, httpx.HTTPError) or answer.status_code >= 500, (answer, answer.text[:600])

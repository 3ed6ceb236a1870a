"""vLLM's own server under rlslurm's engine supervisor (rollout/supervisor.py), as a job runs it: a caller that
disconnects mid-generation has its requests aborted inside vLLM (not generated to the end); an EngineCore
stopped mid-generation (SIGSTOP: /health still answers) is named by vLLM's /metrics and replaced; SIGTERM with
a long generation in flight ends the server and vLLM's engine processes within 5 s. One supervised server,
started twice (the replacement serves the last test). (Every route needing the job's secret:
test_vllm_serve_sync.py.)"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from rlslurm import events, secret
from rlslurm.rollout.config import RolloutConfig
from rlslurm.rollout.supervisor import EngineLaunch, EngineSupervisor
from rlslurm.rollout.vllm_metrics import GENERATED, RUNNING, WAITING, total
from rlslurm.rundir import RunDir
from rlslurm.secret import bearer
from rlslurm.sync.broadcast import free_port
from rollout_fixtures import save_model, tiny_llama
from waiting import wait_for

LONG = {"model": "policy", "prompt": "abc", "n": 64, "max_tokens": 4000, "temperature": 1.0}
"""64 x 4000 tokens (the model has no end-of-sequence token) with attention over up to 4096 positions:
minutes on a CPU, were it not stopped."""


HANG_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def supervised(vllm_python, tmp_path_factory):
    """rollout.engine vllm under its supervisor, on a model with a 4096-token context: a generation that takes
    long enough to stop."""
    root = tmp_path_factory.mktemp("vllm-trust")
    model = save_model(tiny_llama(0, hidden=128, layers=4, context=4096), root / "m", eos=False)
    run = RunDir(root / "run").create()
    spec = EngineLaunch(model_dir=model, host="127.0.0.1", port=free_port(), log_path=run.logs / "engine-0.log",
                        secret_file=secret.ensure(run.secret), engine="vllm", python=str(vllm_python),
                        args=("--max-n", "64", "--max-tokens", "4000", "--run-dir", str(run.path), "--rank", "0",
                              "--heartbeat-interval-s", "0.5", "--phase-timeout-s", "120"),
                        env={"HF_HUB_OFFLINE": "1"},
                        ready_timeout_s=300.0)
    cfg = RolloutConfig(engine="vllm", max_restarts=1, hang_timeout_s=HANG_TIMEOUT_S, health_interval_s=0.5)
    sup = EngineSupervisor(0, spec, cfg, run=run, node="here").start()
    yield sup
    sup.stop()


@pytest.fixture
def long_engine(supervised):
    """The supervised server now serving (the last test's replacement, after the hang test)."""
    return supervised.process


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def counters(engine) -> tuple[float, float]:
    """(requests running + waiting, tokens generated so far): vLLM's own /metrics."""
    samples = engine.client.metrics()
    return total(samples, RUNNING) + total(samples, WAITING), total(samples, GENERATED)


def test_the_vllm_server_beats_as_role_rollout_from_its_own_event_loop(supervised):
    """The engine's phase guard flags reach vLLM's API server (its gate): heartbeats/rollout-0.json carries that
    server's pid, phase rollout, and beats on while it serves."""
    from rlslurm.diag.heartbeat import read_heartbeat

    path = supervised.run.heartbeats / "rollout-0.json"
    first = wait_for("the engine's heartbeat", lambda: (b := read_heartbeat(path)) and b.get("phase") == "rollout"
                     and b, 60, poll_s=0.2)
    assert (first["pid"], first["role"], first["rank"], first["state"]) == (supervised.process.proc.pid, "rollout", 0,
                                                                            "running"), first
    later = wait_for("a later beat", lambda: (b := read_heartbeat(path)) and b["beats"] > first["beats"] and b, 30,
                     poll_s=0.2)
    assert later["pid"] == first["pid"]


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


def test_a_stopped_engine_core_is_named_by_its_metrics_and_replaced(supervised):
    """SIGSTOP of vLLM's EngineCore (a child of the API server): /health keeps answering 200, the running
    requests' tokens stop; the supervisor names it from vLLM's /metrics, kills the tree and starts another."""
    engine = supervised.process
    core = next(p for p in psutil.Process(engine.proc.pid).children() if "EngineCor" in p.name())  # comm: 15 chars
    out: list = []
    post_long(engine, out)
    core.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    assert httpx.get(engine.url + "/health", timeout=5).status_code == 200  # vLLM's own check sees nothing
    (unhealthy,) = wait_for("engine_unhealthy", lambda: events.read_events(supervised.run, events.ENGINE_UNHEALTHY),
                            timeout_s=60)
    named_s = time.monotonic() - stopped
    assert "vLLM's /metrics" in unhealthy["cause"] and "requests running" in unhealthy["cause"], unhealthy
    assert unhealthy["pid"] == engine.proc.pid
    (restarted,) = wait_for("the replacement", lambda: events.read_events(supervised.run, events.ENGINE_RESTARTED),
                            timeout_s=300)
    assert restarted["reason"] == "hung" and supervised.pid != engine.proc.pid and not running(core)
    assert supervised.process.client.completions(["abc"], max_tokens=4)["choices"]  # the replacement serves
    print(f"FIGURE vllm_engine_core_sigstop: named {named_s:.1f} s after SIGSTOP (rollout.hang_timeout_s "
          f"{HANG_TIMEOUT_S:g}), replacement serving {restarted['start_s']:.1f} s after the kill")


def test_sigterm_ends_the_vllm_server_within_5_s_with_a_request_in_flight(supervised, long_engine):
    supervised.stopping()  # the server is stopped from outside, as SLURM's SIGTERM does: no replacement
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

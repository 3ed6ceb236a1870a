"""How rlslurm starts vLLM's own server (rollout/vllm_serve.py, pure parts): its command line, its environment,
the job's limits taken from the rollout server flags, and the gate's body bounds. The server itself runs in
tests/vllm/test_vllm_serve_sync.py and test_vllm_serve_tp.py."""

from __future__ import annotations

import json

import pytest

from rlslurm import secret
from rlslurm.rollout.config import RolloutConfig
from rlslurm.rollout.vllm_serve import GATE, LIMITS_ENV, SecretGate, limits_of, serve_command, serve_env


def test_the_command_is_vllms_server_with_the_gate_the_transfer_engine_and_tp():
    cmd = serve_command("/m", python="/v/python", host="10.0.0.1", port=8000, tp=2, gpu_memory_utilization=0.1)
    assert cmd[:3] == ["/v/python", "-m", "rlslurm.rollout.vllm_api"]
    flags = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1)}
    assert flags["--tensor-parallel-size"] == "2" and flags["--middleware"] == GATE
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "rlslurm"}
    assert flags["--worker-extension-cls"] == "rlslurm.rollout.vllm_verify.WorkerChecks"
    assert flags["--gpu-memory-utilization"] == "0.1" and flags["--host"] == "10.0.0.1"


def test_the_environment_names_the_secret_file_never_the_secret_and_binds_threads_per_tp_rank(tmp_path):
    path = secret.ensure(tmp_path / "secret")
    env = serve_env(secret_file=path, tp=2, cpu=True, limits={"max_n": 4})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env[secret.ENV_VAR] == str(path)
    assert secret.read(path) not in json.dumps(env)
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve_env(secret_file=path, tp=1, cpu=True, limits={})
    assert "VLLM_CPU_KVCACHE_SPACE" not in serve_env(secret_file=path, tp=2, cpu=False, limits={})


def test_the_limits_are_the_rollout_servers_flags():
    args = RolloutConfig(max_new_tokens=12, max_request_mb=2, open_data_plane=True).server_args(
        samples_per_prompt=8, prompts_per_request=16, eval_prompts=100)
    assert limits_of(args) == {"max_n": 8, "max_tokens": 12, "max_prompts": 100, "max_batch_rows": 128,
                               "max_body_bytes": 2 << 20, "open_data": True}


@pytest.mark.parametrize("body, named", [
    ({"prompt": "a", "n": 9}, "n = 9 is outside [1, 8], this engine's limit (rollout.max_n)"),
    ({"prompt": "a", "max_tokens": 13}, "max_tokens = 13 is outside [1, 12]"),
    ({"prompt": "a", "n": 9.0}, "n = 9 is outside [1, 8]"),
    ({"prompt": "a", "n": "9"}, "n must be a whole number, not a string"),
    ({"prompt": "a", "n": 8, "max_tokens": 12}, None),
    ({"prompt": "a", "n": 8.0, "max_tokens": 12.0}, None),
])
def test_the_gate_bounds_n_and_max_tokens(body, named, tmp_path, monkeypatch):
    monkeypatch.setenv(secret.ENV_VAR, str(secret.ensure(tmp_path / "secret")))
    monkeypatch.setenv(LIMITS_ENV, json.dumps({"max_n": 8, "max_tokens": 12}))
    gate = SecretGate(app=None)
    problem = gate.check_body("/v1/completions", json.dumps(body).encode())
    assert problem == named if named is None else named in problem
    assert gate.check_body("/update_weights", json.dumps({"n": 99}).encode()) is None  # admin bodies: size only


def test_the_gate_refuses_to_start_without_a_secret(monkeypatch):
    from rlslurm.errors import RunDirError

    monkeypatch.delenv(secret.ENV_VAR, raising=False)
    with pytest.raises(RunDirError):
        SecretGate(app=None)


def test_the_gate_knows_its_routes_and_refuses_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv(secret.ENV_VAR, str(secret.ensure(tmp_path / "secret")))
    gate = SecretGate(app=None)
    for path in ("/v1/completions", "/invocations", "/tokenize", "/collective_rpc", "/health", "/metrics"):
        assert gate.check_route(path) is None, path
    for path in ("/v1/responses", "/inference/v1/generate", "/sleep", "/v1/completions/", "/docs", "/pooling"):
        assert "not served through rlslurm's gate" in gate.check_route(path), path
    assert gate.max_body_bytes("/tokenize") == gate.max_body_bytes("/v1/completions") == 16 << 20
    assert gate.max_body_bytes("/update_weights") == 64 << 20


def test_the_gate_closes_every_websocket(tmp_path, monkeypatch):
    import asyncio

    path = secret.ensure(tmp_path / "secret")
    monkeypatch.setenv(secret.ENV_VAR, str(path))
    reached: list = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    gate, sent = SecretGate(app), []

    async def send(message):
        sent.append(message)

    def connect(headers):
        scope = {"type": "websocket", "path": "/v1/realtime", "headers": headers}
        asyncio.run(gate(scope, None, send))

    connect([])
    connect([(b"authorization", b"Bearer wrong")])
    connect([(b"authorization", f"Bearer {secret.read(path)}".encode())])  # the job uses none: closed to all
    assert sent == [{"type": "websocket.close", "code": 1008}] * 3 and not reached

"""Which engine server a job runs (rollout.engine): rlslurm's transformers server (hf) or vLLM's own (vllm), started
and reached through one pair of functions, so the callers never choose between them.

    engine = spawn_engine(model_dir, port=p, log_path=run.logs / "engine-0.log", secret_file=run.secret)
    client = connect(url, token=secret.read(run.secret), engine=job.rollout.engine)

rlslurm/rollout/client.py is the hf server's client and process, which vLLM's client (vllm_client.py) and
launcher (vllm_serve.py) build on; this module sits above all three.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from rlslurm import lifetime, prefork, secret
from rlslurm.rollout.client import EngineClient, EngineProcess, EngineRequestError

log = logging.getLogger(__name__)


def connect(url: str, timeout_s: float = 120.0, *, token: str | None = None, engine: str = "hf",
            tp: int = 1) -> EngineClient:
    """The client of an engine server announced at `url`: rollout.engine vllm is vLLM's own server."""
    if engine == "vllm":
        from rlslurm.rollout.vllm_client import VLLMServeClient

        return VLLMServeClient(url, timeout_s, token=token, tp=tp)
    return EngineClient(url, timeout_s, token=token)


def spawn_engine(model_dir: str | Path, *, port: int, host: str = "127.0.0.1", log_path: str | Path,
                 secret_file: str | Path | None = None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 120.0, timeout_s: float = 120.0,
                 engine: str = "hf", python: str | None = None, tp: int = 1) -> EngineProcess:
    """Start `python -m rlslurm.rollout.server` and wait until it answers /health; rollout.engine vllm:
    vLLM's own OpenAI server instead (rollout/vllm_serve.py), with `tp` workers and `extra_args`' limits.

    `engine` is rollout.engine (hf | vllm); `python` is rollout.python, the interpreter of the server
    process (None = this one; the vLLM engine lives in its own venv, .venv-vllm). `secret_file` is the
    job's (<run>/secret); without one the engine gets a secret of its own beside its log (mode 0600).
    The server is handed the file's path, never the secret: argv and env are visible to `ps`.
    """
    if engine == "vllm":
        from rlslurm.rollout.vllm_serve import spawn_for_server_args

        return spawn_for_server_args(model_dir, port=port, host=host, log_path=log_path, secret_file=secret_file,
                                     server_args=extra_args or [], env=env, timeout_s=timeout_s, tp=tp,
                                     python=python or sys.executable, ready_timeout_s=max(ready_timeout_s, 300.0))
    log_path = Path(log_path)
    secret_file = secret.ensure(secret_file or log_path.with_name(log_path.name + ".secret"))
    if engine != "hf":
        raise ValueError(f"rollout.engine {engine!r}: hf (rlslurm's transformers server) or vllm (vLLM's own)")
    cmd = [python or sys.executable, "-m", "rlslurm.rollout.server", "--model", str(model_dir), "--host", host,
           "--port", str(port), "--secret-file", str(secret_file), *(extra_args or [])]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {}), **lifetime.child_env()}
    # Rank 0 forked by the local supervisor planted a copy of itself with torch and transformers imported: the
    # first engine grows from it (rlslurm/prefork.py); any other start is a fresh interpreter.
    proc = prefork.grow(cmd[2], cmd[3:], full_env, str(log_path)) if cmd[0] == sys.executable else None
    if proc is None:
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    client = EngineClient(f"http://{host}:{port}", timeout_s, token=secret.read(secret_file))
    log.info("started engine pid %d at %s (log %s)", proc.pid, client.url, log_path)
    try:
        client.wait_ready(ready_timeout_s, alive=lambda: proc.poll() is None)
    except EngineRequestError as e:
        proc.kill()
        tail = log_path.read_text(errors="replace")[-2000:]
        raise EngineRequestError(f"{e}\n--- tail of {log_path} ---\n{tail}", url=e.url, call=e.call) from None
    return EngineProcess(proc, client, log_path)

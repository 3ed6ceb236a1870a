"""vLLM's API server as rlslurm starts it: vLLM's own `api_server` main, with uvicorn's HTTP protocol guarded
(rlslurm/connguard.py) before vLLM builds its server. Run in the rollout venv by rollout/vllm_serve.py:

    .venv-vllm/bin/python -m rlslurm.rollout.vllm_api --model DIR --middleware rlslurm.rollout.vllm_serve.SecretGate ...

Why a module of its own: vLLM makes its uvicorn.Config itself and takes no protocol class, and rlslurm's gate
(an ASGI middleware) runs only once a request's head has arrived; the head deadline, the bound on connections
without the secret and the one-answer rule for them act on the connection, before that. So this process's
"auto" protocol is made the guarded one, then vLLM's main runs as `python -m vllm.entrypoints.openai.api_server`
would run it. The secret comes from RLSLURM_SECRET_FILE, as the gate's does (without one the gate refuses to
start, with its own message). One API server process, as rlslurm runs it: `--api-server-count` > 1 would start
others that this module never runs in.
"""

from __future__ import annotations


def main() -> None:
    import os

    from rlslurm import connguard, secret

    path = os.environ.get(secret.ENV_VAR)
    connguard.install(secret.read(path) if path else None)
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()

"""The RL job's other het components on SLURM: one rollout engine server, and the reward service.

    python -m rlslurm.jobs.entry --run-dir D --role rollout     # jobs/entry.py calls run_engine
    python -m rlslurm.jobs.entry --run-dir D --role reward      # ... and run_reward

Each announces where it listens in <run>/endpoints/ (stamped with the job id and restart count, so the
controller of a requeued job never takes a previous start's URL) and serves until SLURM or the
trainer's rank 0 stops its component.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rlslurm import lifecycle
from rlslurm.config import JobConfig
from rlslurm.diag.env_diff import write_fingerprint
from rlslurm.dist import free_port
from rlslurm.errors import RlslurmError
from rlslurm.node import node_name
from rlslurm.rl.controller import reward_config, reward_env
from rlslurm.rl.engines import engine_args, engine_limits
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)


def run_engine(job: JobConfig, run_dir: str | Path) -> int:
    """One rollout engine server of the rollout het component; announces its URL in <run>/endpoints/.

    Lifecycle: it serves until the trainer's rank 0 stops the component (SIGTERM to its tasks, see
    hetjob.ComponentStep.stop) or SLURM ends the job (requeue, cancel: SIGTERM too); either way the work
    in flight is dropped (its callers get 503) and the engine exits 0 within seconds. A drain reaches it as
    the controller's /admin/drain (Engines.drain), not as a signal of its own. It listens on the node's
    address (the one it announces), never on every interface, and requires the job's secret.
    """
    from rlslurm.dist import node_address
    from rlslurm.rollout import server

    # `scancel -s USR1` and --signal=USR1@N reach every step, this one too; USR1's default action would
    # kill the engine while the trainer still finishes its step. The trainer ranks agree on the drain
    # step and the controller drains the engines then.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # The server stops on SIGTERM (rollout/server.py), then raises the signal again under the handler
    # found at its start: this one makes that an exit 0, so srun and SLURM see a clean end of the
    # component (a SIGTERM while it waits for the model ends it cleanly too).
    signal.signal(signal.SIGTERM, _exit_cleanly)
    run_ = RunDir(Path(run_dir))
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    write_fingerprint(run_, "rollout", rank)
    model_dir = Path(job.train.init_from) if job.train.init_from else run_.path / "export" / "init"
    deadline = time.monotonic() + job.rollout.request_timeout_s
    while not (model_dir / "config.json").is_file():  # the controller writes the random init
        if time.monotonic() > deadline:
            raise RlslurmError(f"no model in {model_dir} after {job.rollout.request_timeout_s:.0f} s")
        time.sleep(0.5)
    node = node_name()
    host, port = node_address(node), free_port()
    folder = run_.path / "endpoints"
    folder.mkdir(exist_ok=True)
    tmp = folder / f".engine-{rank}.json.tmp"
    # job id and restart count: the controller of a requeued job must not take the previous start's URL.
    tmp.write_text(json.dumps({"url": f"http://{host}:{port}", "node": node, "pid": os.getpid(),
                               "job_id": lifecycle.leader_job_id(), "restart_count": lifecycle.restart_count()}))
    os.replace(tmp, folder / f"engine-{rank}.json")
    # The address announced is the one bound: peers reach it, nothing else on the node's other interfaces.
    argv = ["--model", str(model_dir), "--host", host, "--port", str(port), "--secret-file", str(run_.secret),
            *engine_args(job), *engine_limits(job), "--engine", job.rollout.engine]
    if job.rollout.engine == "vllm":  # vLLM's own OpenAI server (rollout/vllm_serve.py), this task becomes it
        from rlslurm.rollout.vllm_serve import exec_serve

        log.info("engine %d: exec vLLM's OpenAI server (tp %d)", rank, job.rollout.tp)
        exec_serve(model_dir, python=job.rollout.python or sys.executable, host=host, port=port,
                   secret_file=run_.secret, tp=job.rollout.tp, server_args=engine_limits(job))
    if job.rollout.python:
        # Another engine lives in its own venv (vLLM: .venv-vllm): become its server process, so this
        # SLURM task is the server and SLURM's signals reach it directly (USR1 stays ignored across exec).
        python = job.rollout.python or sys.executable
        log.info("engine %d: exec %s -m rlslurm.rollout.server (engine %s)", rank, python, job.rollout.engine)
        os.execv(python, [python, "-m", "rlslurm.rollout.server", *argv])
    try:
        server.main(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    log.info("engine %d on %s stopped: exiting 0", rank, node)
    return 0


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def run_reward(job: JobConfig, run_dir: str | Path) -> int:
    """The reward het component: the supervised reward service (rlslurm/reward/) on this node, announced
    in <run>/endpoints/reward.json for the controller.

    Lifecycle: it serves until the trainer's rank 0 stops the component (SIGTERM through srun), or raises
    RewardServiceError once its supervisor gave up (past reward.max_restarts); the supervisor's events
    reach the controller through the run directory, so its steps count the restarts. The service listens on
    the node's address (the one announced) and requires the job's secret.
    """
    from rlslurm.dist import node_address
    from rlslurm.errors import RewardServiceError
    from rlslurm.reward.session import announce
    from rlslurm.reward.supervisor import RewardSupervisor

    # USR1 (`scancel -s USR1`, --signal=USR1@N) reaches this step too: nothing here to drain, and its
    # default action would kill the service while the trainer still finishes its step.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    run_ = RunDir(Path(run_dir))
    node = node_name()
    host = node_address(node)
    with RewardSupervisor(reward_config(job), run=run_, bind=host, diag=job.diag, env=reward_env(job)) as sup:
        announce(run_, sup.url, node)
        log.info("reward service on %s, supervised", sup.url)
        while not stop.wait(1.0):
            if sup.failed.is_set():
                raise RewardServiceError(f"the reward service on {node} failed past reward.max_restarts = "
                                         f"{job.reward.max_restarts}; see {run_.logs}/reward-service.log")
    log.info("reward service on %s stopped: exiting 0", node)
    return 0

"""The RL job's other het components on SLURM: one rollout engine server, and the reward service.

    python -m rlslurm.jobs.entry --run-dir D --role rollout     # jobs/entry.py calls run_engine
    python -m rlslurm.jobs.entry --run-dir D --role reward      # ... and run_reward

Each announces where it listens in <run>/endpoints/ (stamped with the job id and restart count, so the
controller of a requeued job never takes a previous start's URL) and serves until SLURM or the
trainer's rank 0 stops its component.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from rlslurm.config import JobConfig
from rlslurm.diag.env_diff import write_fingerprint
from rlslurm.errors import RlslurmError
from rlslurm.lifetime import StopFlag
from rlslurm.node import node_name
from rlslurm.rl.engines import endpoint_stamp, engine_launch
from rlslurm.rl.scoring import reward_config, reward_env
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)


def run_engine(job: JobConfig, run_dir: str | Path) -> int:
    """One supervised rollout engine server of the rollout het component (engine index = SLURM_PROCID);
    its supervisor (rlslurm/rollout/supervisor.py, the same as the controller's for spawned engines)
    announces its URL in <run>/endpoints/engine-<index>.json and replaces it when it dies or hangs, within
    rollout.max_restarts.

    Lifecycle: it serves until the trainer's rank 0 stops the component (SIGTERM to its tasks, see
    hetjob.ComponentStep.stop) or SLURM ends the job (requeue, cancel: SIGTERM too); either way the work
    in flight is dropped (its callers get 503) and the task exits 0 within seconds. Past the restart budget
    (`engine_down`, its announcement says down) the task ends too, exit 0: an engine that leaves the rotation
    leaves alone. A failed task would end its siblings with it (one srun step runs every engine of the
    component; issue 38: the healthy engine went down with the one past its budget); the controller takes
    it out of rotation for good from the announcement and goes on with the others (rl/engines.py
    check_down; every engine down: the job fails naming them). A drain
    reaches the engine as the controller's /admin/drain (Engines.drain), not as a signal of its own. It
    listens on the node's address (the one it announces), never on every interface, and requires the job's
    secret.
    """
    from rlslurm.dist import node_address
    from rlslurm.rollout.client import EngineRequestError
    from rlslurm.rollout.supervisor import EngineSupervisor

    # `scancel -s USR1` and --signal=USR1@N reach every step, this one too; USR1's default action would
    # kill the engine while the trainer still finishes its step. Ignored here, it stays ignored in the
    # engine server the supervisor starts (an ignored signal survives exec). The trainer ranks agree on the
    # drain step and the controller drains the engines then.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    stop = StopFlag()  # set from a signal handler: no Event (its lock)
    supervised: list[EngineSupervisor] = []

    def stopping(*_) -> None:
        # SLURM's SIGTERM reaches the engine server too: its supervisor must not take that for a death.
        stop.set()
        for sup in supervised:
            sup.stopping()

    signal.signal(signal.SIGTERM, stopping)
    run_ = RunDir(Path(run_dir))
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    write_fingerprint(run_, "rollout", rank)
    model_dir = Path(job.train.init_from) if job.train.init_from else run_.path / "export" / "init"
    deadline = time.monotonic() + job.rollout.request_timeout_s
    while not (model_dir / "config.json").is_file():  # the controller writes the random init
        if time.monotonic() > deadline:
            raise RlslurmError(f"no model in {model_dir} after {job.rollout.request_timeout_s:.0f} s")
        if stop.wait(0.5):
            return 0
    node = node_name()
    # The address announced is the one bound: peers reach it, nothing else on the node's other interfaces.
    spec = engine_launch(job, run_, rank, model_dir, host=node_address(node))
    sup = EngineSupervisor(rank, spec, job.rollout, run=run_, node=node, stamp=endpoint_stamp())
    supervised.append(sup)
    try:
        try:
            sup.start()
        except EngineRequestError:
            if stop.is_set():  # SLURM's SIGTERM ended the server while it loaded: a clean end of the component
                log.info("engine %d on %s stopped while starting: exiting 0", rank, node)
                return 0
            raise
        log.info("engine %d on %s, supervised", rank, sup.url)
        while not stop.wait(1.0):
            if sup.failed.is_set():
                log.error("rollout engine %d on %s failed past rollout.max_restarts = %d (see %s): it leaves the "
                          "rotation; this task ends, its sibling engines serve on: exiting 0", rank, node,
                          job.rollout.max_restarts, spec.log_path)
                return 0
    finally:
        sup.stop()
    log.info("engine %d on %s stopped: exiting 0", rank, node)
    return 0


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
    stop = StopFlag()  # set from a signal handler: no Event (its lock)
    supervised: list[RewardSupervisor] = []

    def stopping(*_) -> None:
        # SLURM's SIGTERM reaches the service too: its supervisor must not take its exit for a death.
        stop.set()
        for sup in supervised:
            sup.stopping()

    signal.signal(signal.SIGTERM, stopping)
    run_ = RunDir(Path(run_dir))
    node = node_name()
    host = node_address(node)
    with RewardSupervisor(reward_config(job), run=run_, bind=host, diag=job.diag, env=reward_env(job)) as sup:
        supervised.append(sup)
        announce(run_, sup.url, node)
        log.info("reward service on %s, supervised", sup.url)
        while not stop.wait(1.0):
            if sup.failed.is_set():
                raise RewardServiceError(f"the reward service on {node} failed past reward.max_restarts = "
                                         f"{job.reward.max_restarts}; see {run_.logs}/reward-service.log")
    log.info("reward service on %s stopped: exiting 0", node)
    return 0

"""The one entry of every job process: picks the role from where the task runs, then the entrance.

    submitit pickles `run_component(run_dir)`: it runs in every task of het component 0 (SLURM) or in
    every local task. Other components are started by the trainer supervisor of the batch shell
    (rlslurm/slurm/supervisor.py), which also restarts these tasks when one dies:
    python -m rlslurm.jobs.entry --run-dir D --role rollout|reward

Roles: `train` (trainer ranks; rank 0 is also the controller), `rollout` (engines), `reward` (the
reward service). Entrances by `job.kind`: toy (the spine's deterministic loop), sft, rl.
The return value is the lifecycle exit code (rlslurm/lifecycle.py); codes that mean "a human must look"
raise, so SLURM and submitit record a failure.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import click

from rlslurm.config import load_config
from rlslurm.errors import RlslurmError
from rlslurm.layout import JobLayout
from rlslurm.lifecycle import ExitCode, leader_job_id, needs_requeue, requeue_job
from rlslurm.node import node_name
from rlslurm.rundir import ENV_VAR, RunDir

log = logging.getLogger("rlslurm.jobs.entry")


def _record_placement(run: RunDir, role: str, local_rank: int) -> None:
    """Where this task landed and the GPUs it was given: one line per task and start in placement.jsonl
    (diag bundles it, find_run looks job ids up in it)."""
    from rlslurm.devices import seen
    from rlslurm.slurm.hetjob import component_job_id

    run.append_json(run.path / "placement.jsonl", {
        "t": time.time(), "role": role, "rank": int(os.environ.get("RLSLURM_RANK", "0")), "local_rank": local_rank,
        "node": node_name(), "partition": os.environ.get("SLURM_JOB_PARTITION"), "job_id": leader_job_id(),
        # This component's own id (13 of het job 12): `rlslurm status 13` finds the run by it.
        "slurm_job_id": component_job_id(),
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "pid": os.getpid(),
        **seen(JobLayout.read(run), role, local_rank),
    })


def node_agent_log(run: RunDir, role: str) -> Path:
    """Where the node agent of this node writes its log."""
    return run.logs / f"watchdog-{role}-{node_name()}.log"


def keep_node_agent(run: RunDir, role: str):
    """The node agent, kept: its death is a `node_agent_died` event and a restart (diag/agent.py)."""
    from rlslurm.diag.agent import AgentKeeper

    return AgentKeeper(run, lambda: start_node_agent(run, role), log_path=node_agent_log(run, role), node=node_name())


def start_node_agent(run: RunDir, role: str) -> subprocess.Popen:
    """The watchdog of this node (diag/watchdog.py): a separate process, since a rank wedged in C code
    or holding the GIL cannot watch itself. It exits by itself once every watched process is gone."""
    node = node_name()
    argv = [sys.executable, "-m", "rlslurm.diag.watchdog", "--run-dir", str(run.path), "--host", node]
    if leader_job_id():
        argv += ["--job-id", leader_job_id()]
    log_path = node_agent_log(run, role)
    # A new session: the agent must outlive a SIGTERM that SLURM sends to the step's process group
    # long enough to dump stacks. It is still in the step's process tree, which is what SLURM signals
    # (proctrack/linuxproc), so USR1 reached it and killed it: started with USR1 ignored, it stays so
    # across exec.
    if threading.current_thread() is not threading.main_thread():
        # A restart by the agent's keeper (diag/agent.py) runs in its thread, where signal.signal is refused:
        # a shell ignores USR1 the same way before it execs the agent.
        with open(log_path, "ab") as out:
            return subprocess.Popen(["sh", "-c", 'trap "" USR1; exec "$@"', "sh", *argv], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with open(log_path, "ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _keep_early_drain_signal(run: RunDir) -> None:
    """Until the trainer's drain gate is up, USR1 (the pre-timeout signal, `scancel -s USR1`) would kill
    this rank (its default action): keep it as the run's control/drain request, which every rank's gate
    reads at its first step boundary. With a short time limit SLURM sends it up to a minute early."""
    from rlslurm.diag.drain_gate import request_drain

    def on_usr1(signum, frame):
        request_drain(run, "SIGUSR1 before the trainer's drain gate was up")

    signal.signal(signal.SIGUSR1, on_usr1)


def _plant_engine(run: RunDir) -> None:
    """Trainer rank 0 of an RL job, forked by the local supervisor with torch and transformers imported
    (rlslurm/prefork.py): a copy of itself, made while it runs one thread, that its first spawned engine grows from
    (rollout/launcher.py spawn_engine) instead of a fresh interpreter importing them again."""
    from rlslurm import prefork

    if os.environ.get(prefork.PREFORKED_ENV) == "1" and os.environ.get("SUBMITIT_LOCAL_GLOBALID") == "0" \
            and load_config(run.config).job.kind == "rl":
        prefork.plant()


def _train_role(run: RunDir) -> int:
    job = load_config(run.config)
    rank = int(os.environ["RLSLURM_RANK"])  # this task's rank in the job (run_component: Topology.detect)
    if job.job.kind == "rl":
        from rlslurm.rl import early

        # Rank 0's engines load while this rank imports torch and loads the policy.
        if early.start_engines(job, run, rank):
            try:
                return _capped_entrance(run, job, rank)
            finally:
                early.abandon()
    return _capped_entrance(run, job, rank)


def _capped_entrance(run: RunDir, job, rank: int) -> int:
    """The cpu profile's hbm_gb enforced like a GPU's (rlslurm/memcap.py), on what the rank allocates once the
    libraries it trains with are in: those are what a GPU's runtime holds outside its HBM."""
    from rlslurm.memcap import cap_rank

    if job.hardware.profile == "cpu":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    cap_rank(run, job, int(os.environ.get("RANK", "0")))
    return _entrance(run, job, rank)


def _entrance(run: RunDir, job, rank: int) -> int:
    """The job kind's entrance, after this rank's env fingerprint."""
    from rlslurm.diag.env_diff import write_fingerprint

    write_fingerprint(run, "train", rank)
    kind = job.job.kind
    if kind == "toy":
        from rlslurm.jobs import toytrain

        return int(toytrain.train(run.path, job, step_delay_s=job.train.step_delay_s))
    if kind == "sft":
        from rlslurm.jobs import sft

        return int(sft.run_sft(job, run.path)["exit_code"])
    from rlslurm.jobs import rl

    return int(rl.run(job, run.path) or 0)


def _export_local_ranks() -> None:
    """Under submitit's local executor, give this task torchrun's RANK / WORLD_SIZE / LOCAL_RANK.

    Every library the job uses (torch.distributed's env:// init, the diag kit) then reads one set of names;
    submitit's JobEnvironment is the reader that follows submitit's own.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") != "local" or "RANK" in os.environ:
        return
    import submitit

    env = submitit.JobEnvironment()
    os.environ.update(RANK=str(env.global_rank), WORLD_SIZE=str(env.num_tasks), LOCAL_RANK=str(env.local_rank))


def run_component(run_dir: str) -> int:
    """What `rlslurm submit` pickles: the train role of component 0 (and the launcher of the others)."""
    run = RunDir(Path(run_dir))
    _plant_engine(run)  # before this process starts any thread
    _keep_early_drain_signal(run)
    from rlslurm import lifetime

    # Off SLURM the local controller named itself (RLSLURM_PARENT_PID): this rank ends with it. On SLURM
    # nothing is named, and slurmstepd's own tracking ends the step's processes.
    lifetime.bind_to_parent()
    os.environ[ENV_VAR] = str(run.path)
    os.environ["RLSLURM_ROLE"] = "train"
    from rlslurm.dist import Topology

    _export_local_ranks()
    from rlslurm.dist import bind_to_node_address

    bind_to_node_address()  # before any process group: every collective binds the address SLURM gives
    topo = Topology.detect()
    os.environ["RLSLURM_RANK"] = str(topo.rank)
    _record_placement(run, "train", topo.local_rank)
    if topo.is_main and leader_job_id():
        from rlslurm.lifecycle import name_lost_nodes, restart_count

        name_lost_nodes(run, restart_count())  # SLURM requeued us off a lost node: say which
    agent = keep_node_agent(run, "train") if topo.local_rank == 0 else None
    # The other components (engines, reward) are not started here: on SLURM the trainer supervisor of the batch
    # shell started them once and keeps them across a restart of these ranks (rlslurm/slurm/supervisor.py).
    code = None
    try:
        code = _train_role(run)
        # Trained or drained: a late USR1 has nothing left to stop, and a drain file now would stop the next start.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    finally:
        from rlslurm import prefork

        prefork.discard()  # a planted copy no engine grew from (a vLLM engine, engines of their own component)
        if agent is not None:
            agent.stop()
    if needs_requeue(code) and topo.is_main and leader_job_id():
        requeue_job(leader_job_id())
    if code in (ExitCode.DONE, ExitCode.DRAINED, ExitCode.HANG_DETECTED):
        return code
    raise RlslurmError(f"rank {topo.rank} of {run.path} ended with exit code {code} ({ExitCode(code).name}); "
                       f"see {run.events}")


def _stand_in(run: RunDir, role: str) -> int:
    """The toy job's other components: record where they run, beat, and wait to be stopped.

    The spine's tests need a real het component on the rollout partition before the RL engines exist;
    this process is that component: it shows placement, heartbeats and env fingerprints like an engine.
    """
    from rlslurm.lifetime import StopFlag

    stop = StopFlag()  # set from a signal handler: no Event (its lock)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # USR1 reaches this component too (`scancel -s USR1` of the het job, srun forwarding it): it has no
    # work in flight to drain, and by default USR1 would kill it. The trainer's rank 0 stops it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    while not stop.wait(1.0):
        pass
    return 0


@click.command()
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="The run directory.")
@click.option("--role", type=click.Choice(["rollout", "reward"]), required=True, help="Which component this is.")
def main(run_dir: str, role: str) -> None:
    # The het job's USR1 (`scancel -s USR1`, --signal=USR1@N) reaches these steps too; its default
    # action would kill a component that is still loading. The trainer decides the drain and stops us.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    run = RunDir(Path(run_dir))
    os.environ[ENV_VAR] = str(run.path)
    os.environ["RLSLURM_ROLE"] = role
    # Its rank in its component; not setdefault: srun passed on trainer rank 0's RLSLURM_RANK=0 to every task,
    # and two engines of one node then wrote one env fingerprint and one placement rank.
    os.environ["RLSLURM_RANK"] = os.environ.get("SLURM_PROCID", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(name)s: %(message)s")
    _record_placement(run, role, int(os.environ.get("SLURM_LOCALID", "0")))
    job = load_config(run.config)
    from rlslurm.diag.env_diff import write_fingerprint
    from rlslurm.dist import bind_to_node_address

    bind_to_node_address()  # the weight-sync group of an engine binds the address SLURM gives its node

    write_fingerprint(run, role, int(os.environ["RLSLURM_RANK"]))
    if job.job.kind == "rl" and role == "rollout":
        from rlslurm.jobs import rl

        sys.exit(rl.run_engine(job, run.path))
    if job.job.kind == "rl" and role == "reward":
        from rlslurm.jobs import rl

        sys.exit(rl.run_reward(job, run.path))
    sys.exit(_stand_in(run, role))


if __name__ == "__main__":
    main()

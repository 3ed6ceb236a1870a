"""The local backend's trainer supervisor: submitit's local controller, with the SLURM supervisor's rules.

    rlslurm submit job.yaml --backend local      # launch._submit_local runs its ranks through this controller

Off SLURM, submitit's LocalExecutor runs the ranks from a controller process of its own (`python -m
submitit.local._local`), which waits for every rank and starts them again only when one exits with its
requeue code. So a SIGKILLed rank left its peers waiting in a gloo collective for train.dist_timeout_s, and
the run ended. This controller is submitit's, with two changes taken from the SLURM path
(rlslurm/slurm/supervisor.py, whose `decide` it calls):

- the first rank that ends badly ends its peers at once (SIGTERM, then SIGKILL after `KILL_WAIT_S`): what
  srun's `--kill-on-bad-exit=1` does to the trainer step;
- a rank killed by a crash signal (SIGKILL, SIGSEGV, the OOM killer's SIGKILL) starts every rank again, up to
  `train.max_restarts`, with the same `trainer_restarted` event and RLSLURM_TRAINER_RESTART; the new ranks
  resume from the newest complete checkpoint. Past the budget the run ends as before: there is no queue to
  go back to on one machine;
- a rank still running `train.exit_grace_s` after rank 0 exited 0 (past the final barrier: the work is done,
  what is left is teardown) has its stacks dumped, is ended and named (`rank_outlived_job`, `rlslurm status`),
  and counts as finished: a teardown that hangs never holds a finished job.

The ranks are forks of this process, which imported torch and transformers once before it starts them, and rank
0's first engine a fork of rank 0 (rlslurm/prefork.py: one import on the start's critical path instead of three, and
their pages shared); RLSLURM_PREFORK=0 starts each rank as submitit does, a fresh interpreter.

Engines spawned by rank 0 (the local backend's separate placement) are its children: they end with it and
the new rank 0 starts them again, as colocated engines do on SLURM. A SIGKILLed rank cannot stop them
itself, so this controller is a child subreaper (what SLURM's proctrack is for a job step): whatever a rank
leaves running becomes this process's child, and is ended once the ranks have ended (measured before it:
a SIGKILLed rank 0's engine server ran on, reparented to init, after the run was done). The ranks in
turn end with this controller (lifetime.bind_to_parent: SIGTERM, so they drain as for SLURM's): a SIGKILLed
controller leaves no rank waiting on a peer or writing heartbeats that make `rlslurm resume` refuse the run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from submitit.core import utils
from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE, Controller, LocalExecutor, LocalJob, LocalJobEnvironment

from rlslurm import events, lifetime, prefork
from rlslurm.rundir import ENV_VAR, RunDir
from rlslurm.slurm.parse import TaskEnd
from rlslurm.slurm.supervisor import RESTART_ENV, decide

log = logging.getLogger("rlslurm.local_supervisor")

LOG_NAME = "local-supervisor.log"
"""<run>/logs/local-supervisor.log: what this controller decided after each end of the ranks."""
PREFORK_ENV = "RLSLURM_PREFORK"
"""0: start each rank as a fresh interpreter (submitit's own way), not forked from this process (rlslurm/prefork.py)."""
ENTRANCES = {"sft": ("rlslurm.jobs.sft",), "rl": ("rlslurm.jobs.rl", "rlslurm.rollout.server")}
"""The job kind's own modules, preloaded with torch for its ranks and rank 0's engine (the server): in each fork they
were 0.2-0.35 s of its start and ~45 MB of the job's PSS (bench_vs_trl: 615 against 660 MB in 6 processes)."""
KILL_WAIT_S = 10.0
"""Seconds the peers of a rank that ended badly get between SIGTERM and SIGKILL (SLURM's KillWait)."""


def become_subreaper() -> bool:
    """prctl(PR_SET_CHILD_SUBREAPER, 1): orphans of this process's descendants become its children (Linux)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # 36: PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def end_leftovers(grace_s: float = KILL_WAIT_S, rounds: int = 3) -> list[int]:
    """End (SIGTERM, SIGKILL after grace_s) and reap every child of this process: after the ranks ended, what
    they left running (an engine server, its workers). Returns their pids."""
    import psutil

    ended: list[int] = []
    for _ in range(rounds):  # an ended engine's own orphans come to us too
        left = psutil.Process().children()
        if not left:
            break
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(left, timeout=grace_s)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        ended += [p.pid for p in left]
    if ended:
        log.info("ended what the ranks left running: pids %s", ended)
    return ended


def task_ends(codes: Sequence[int | None], first: Sequence[int], node: str) -> list[TaskEnd]:
    """Pure: the ranks' exit codes (Popen's: -N for signal N) as srun would report them, the ranks in
    `first` (those that had ended badly when the controller first saw one) before the peers it ended."""
    ends = []
    for task in sorted(range(len(codes)), key=lambda k: k not in first):
        code = codes[task]
        if code is None or code == 0:
            continue
        if code < 0:
            sig = signal.Signals(-code)
            how, name = signal.strsignal(sig) or sig.name, sig.name
        else:
            how, name = f"Exited with exit code {code}", None
        ends.append(TaskEnd(node=node, task=task, how=how, signal=name, after_step_signal=task not in first))
    return ends


def module_command(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """Pure: (module, args) of submitit's task command `python -u -m module args...`; None for any other shape."""
    if len(command) >= 4 and list(command[1:3]) == ["-u", "-m"]:
        return command[3], list(command[4:])
    return None


class RestartingController(Controller):
    """submitit's local Controller (start_tasks, kill_tasks, its timeout signal) run as the module says."""

    def __init__(self, folder: Path, run: RunDir | None = None, exit_grace_s: float = math.inf):
        super().__init__(folder)
        self.stopping = False
        self.first_bad: list[int] = []
        self.run_dir, self.exit_grace_s = run, exit_grace_s

    def end_outlivers(self, codes: list[int | None]) -> list[int | None]:
        """The ranks still running train.exit_grace_s after rank 0 exited 0, named and ended; they count as
        finished. Rank 0 exits 0 only after the final barrier that every rank reached (jobs/sft.py,
        rlslurm/rl/loop.py), so what such a rank still does is teardown: measured once in CI, rank 1 waited for
        good in gloo's process-group destructor after the run was done."""
        from rlslurm.diag.stack_dump import dump_stack

        out = list(codes)
        for k, task in enumerate(self.tasks):
            if out[k] is not None:
                continue
            stack_file = self.run_dir.path / "stacks" / f"outlived-rank{k}-pid{task.pid}.txt"
            dump = dump_stack(task.pid, timeout_s=10.0)
            stack_file.parent.mkdir(parents=True, exist_ok=True)
            stack_file.write_text(dump.text)
            task.terminate()
            try:
                task.wait(timeout=KILL_WAIT_S)
                ended = "SIGTERM"
            except subprocess.TimeoutExpired:
                task.kill()
                task.wait()
                ended = "SIGTERM, SIGKILL"
            log.warning("rank %d (pid %d) still ran %.0f s after rank 0 exited 0: ended (%s), stacks in %s",
                        k, task.pid, self.exit_grace_s, ended, stack_file)
            events.emit(self.run_dir, events.RANK_OUTLIVED_JOB, role="supervisor", rank=k, stuck_rank=k,
                        pid=task.pid, grace_s=self.exit_grace_s, ended=ended, stack_file=str(stack_file),
                        stack_method=dump.method)
            out[k] = 0
        return out

    def preload(self, run: RunDir, job) -> None:
        """Torch, transformers and the job kind's entrance imported here once, for the ranks `start_tasks` forks
        (rlslurm/prefork.py), where the job trains (sft, rl) and RLSLURM_PREFORK is not 0."""
        if job.job.kind not in ("sft", "rl") or os.environ.get(PREFORK_ENV, "1") == "0" or module_command(
                self.command) is None:
            return
        from rlslurm.layout import JobLayout
        from rlslurm.rl.engines import preload_env

        seconds = prefork.preload(preload_env(job, JobLayout.read(run)), ENTRANCES[job.job.kind])
        log.info("imported torch and transformers in %.2f s: the ranks are forked from this process", seconds)

    def start_tasks(self) -> None:
        """submitit's start_tasks (each task's environment and log files), the tasks forked from this process once it
        preloaded (`preload`), else started as submitit does."""
        command = module_command(self.command)
        if not prefork.preloaded() or command is None:
            super().start_tasks()
            return
        self.folder.mkdir(exist_ok=True)
        paths = [utils.JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
        self.stdouts = [p.stdout.open("a") for p in paths]
        self.stderrs = self.stdouts if self.stderr_to_stdout else [p.stderr.open("a") for p in paths]
        module, args = command
        for k in range(self.ntasks):
            env = {**os.environ, "SUBMITIT_LOCAL_LOCALID": str(k), "SUBMITIT_LOCAL_GLOBALID": str(k),
                   "SUBMITIT_LOCAL_JOB_ID": self.pid}
            self.tasks.append(prefork.fork_module(module, args, env, self.stdouts[k], self.stderrs[k]))

    def _forward_signal(self, signum, *args) -> None:
        if signum == signal.SIGTERM:  # the user's cancel (LocalJob.cancel): no restart after it
            self.stopping = True
        super()._forward_signal(signum, *args)

    def wait(self, freq: int = 24) -> Sequence[int | None]:
        """Controller.wait (every rank's end, the timeout signal), and the first rank that ends badly ends the
        others: SIGTERM at once, SIGKILL after KILL_WAIT_S."""
        timeout, almost_timeout = freq * self.timeout_s, freq * (self.timeout_s - self.signal_delay_s)
        self.first_bad, killed_at, rank0_done_at = [], None, None
        for step in range(timeout):
            codes = [t.poll() for t in self.tasks]
            if all(c is not None for c in codes):
                return codes
            if codes[0] == 0 and rank0_done_at is None:
                rank0_done_at = time.monotonic()
            if rank0_done_at is not None and time.monotonic() - rank0_done_at > self.exit_grace_s:
                return self.end_outlivers(codes)
            if not self.first_bad and any(c not in (None, 0) for c in codes):
                self.first_bad = [k for k, c in enumerate(codes) if c not in (None, 0)]
                log.info("rank(s) %s ended %s: ending the others", self.first_bad, [codes[k] for k in self.first_bad])
                for t in self.tasks:
                    if t.poll() is None:
                        t.terminate()
                killed_at = time.monotonic()
            elif killed_at is not None and time.monotonic() - killed_at > KILL_WAIT_S:
                for t in self.tasks:
                    if t.poll() is None:
                        t.kill()
                killed_at = None
            if step == almost_timeout:
                super()._forward_signal(LocalJobEnvironment._usr_sig())
            time.sleep(1.0 / freq)
        return [t.poll() for t in self.tasks]

    def run(self, max_retry: int = 6) -> None:
        from rlslurm.config import load_config

        run = RunDir(Path(os.environ[ENV_VAR]))
        if not become_subreaper():
            log.warning("not a child subreaper: what a killed rank leaves running outlives it")
        job = load_config(run.config)
        max_restarts = job.train.max_restarts
        # The ranks end with this controller (rlslurm/lifetime.py): a SIGKILLed controller cannot end them,
        # and nothing else would (no SLURM step around them); start_tasks hands them this environment.
        os.environ.update(lifetime.child_env())
        self.preload(run, job)
        restarts = requeues = 0
        while True:
            os.environ[RESTART_ENV] = str(restarts)  # start_tasks gives each rank this environment
            started = time.time()
            try:
                self.start_tasks()
                codes = self.wait()
            finally:
                self.kill_tasks()
                end_leftovers()
            ends = task_ends(codes, self.first_bad, socket.gethostname())
            hang = any(e.get("t", 0) >= started for e in events.read_events(run, events.HANG_DETECTED))
            verdict = decide(exit_code=0 if all(c == 0 for c in codes) else 1, ends=ends, stopping=self.stopping,
                             job_state=None, hang=hang, lost=[], restarts=restarts, max_restarts=max_restarts)
            log.info("ranks ended %s after %.1f s: %s (%s)", codes, time.time() - started, verdict.action,
                     verdict.reason)
            if verdict.action != "restart":
                if any(c == LOCAL_REQUEUE_RETURN_CODE for c in codes) and requeues < max_retry:
                    requeues += 1  # submitit's own local requeue (a rank asked for it), as its Controller.run does
                    continue
                return
            restarts += 1
            d = verdict.death
            assert d is not None
            events.emit(run, events.TRAINER_RESTARTED, role="supervisor", dead_rank=d.task, node=d.node,
                        cause=d.how, signal=d.signal, trainer_restart=restarts, max_restarts=max_restarts,
                        restart_count=0, srun_exit_code=1, step_s=time.time() - started)


class RestartingLocalExecutor(LocalExecutor):
    """submitit's LocalExecutor whose controller process is this module's."""

    def _submit_command(self, command: str) -> LocalJob:
        # LocalExecutor._submit_command and its start_controller, with this module as the controller:
        # start_controller names submitit's own controller module and takes no other. No `setup` commands.
        ntasks = self.parameters.get("tasks_per_node", 1)
        n_gpus = self.parameters.get("gpus_per_node", 0)
        visible = self.parameters.get("visible_gpus", ())
        gpus = range(n_gpus) if visible == () else visible[:n_gpus]
        env = {**os.environ, "SUBMITIT_LOCAL_NTASKS": str(ntasks), "SUBMITIT_LOCAL_COMMAND": command,
               "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters.get("timeout_min", 2.0))),
               "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
               "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
               "SUBMITIT_STDERR_TO_STDOUT": "1" if self.parameters.get("stderr_to_stdout", False) else "",
               "SUBMITIT_EXECUTOR": "local", "CUDA_VISIBLE_DEVICES": ",".join(str(k) for k in gpus),
               "SUBMITIT_LOCAL_WITH_SHELL": ""}
        # The job (LocalJob) polls and ends this process, as it does submitit's controller.
        process = subprocess.Popen([sys.executable, "-m", "rlslurm.local_supervisor", str(self.folder)], env=env)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))


def main(argv: Sequence[str] | None = None) -> int:
    prefork.ready_titles()  # before anything changes this process's environment
    args = list(sys.argv[1:] if argv is None else argv)
    if ENV_VAR not in os.environ:  # not an rlslurm job: no config, no budget; submitit's controller as it is
        Controller(Path(args[0])).run()
        return 0
    # To a file: this process shares the submitter's stderr, which `rlslurm submit --wait` keeps for its message.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(name)s: %(message)s",
                        filename=str(RunDir(Path(os.environ[ENV_VAR])).logs / LOG_NAME))
    from rlslurm.config import load_config

    run = RunDir(Path(os.environ[ENV_VAR]))
    RestartingController(Path(args[0]), run, load_config(run.config).train.exit_grace_s).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

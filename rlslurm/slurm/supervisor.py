"""The trainer supervisor: the batch shell's process on SLURM; it restarts dead trainer ranks inside the allocation.

    exec python -u -m rlslurm.slurm.supervisor -- srun ... --kill-on-bad-exit=1 python -m submitit.core._submit F

(the last line of every sbatch script rlslurm/slurm/hetjob.py renders; tests/golden/*.sbatch).

Why a process of its own: component 0's ranks are one job step, and before this rank 0 also started the engines
(`srun --het-group=1`) from inside itself, so one dead rank ended the step and rank 0's death took the engines
with it: the only way back was a requeue (the back of the queue, hours on a busy cluster). This process outlives
the ranks. It starts the other components once (their steps are its children, so a trainer restart keeps
them), arms the lost-node triggers (rlslurm/slurm/rejoin.py), then runs the trainer step (submitit's own
`_submit` command, one task per rank) in a loop:

- the step ended 0 (done, drained, a hang the job handled): leave, as before;
- a rank died by a signal (SIGKILL, segfault, OOM kill; which rank and how: srun's own `task N: Killed` line,
  parse.srun_task_ends) while the job still runs and every node of component 0 is up: emit
  `trainer_restarted` and run the step again, a new job step on the same nodes, up to `train.max_restarts`
  per allocation. The new ranks resume from the newest complete checkpoint as a requeued start does; the
  controller finds the running engines by their endpoint files (same job id and restart count) and brings
  them to its version with a verified sync before any rollout (rlslurm/rl/loop.py `_first_sync`; a
  broadcast group is joined anew, the engine drops the old one);
- the budget spent or a node of component 0 lost: `trainer_restarts_spent`, `scontrol requeue` of the leader,
  then SLURM asked to keep the requeued job off the failed node (ExcNodeList, rejoin.keep_off; recorded in
  <run>/excluded_nodes.json, which `rlslurm status` shows);
- anything else (an exception's exit 1, NO_PROGRESS, SLURM ending the job): leave; the job's exit-code
  contract (rlslurm/lifecycle.py) applies as before.

SIGTERM to this process (a requeue, a preemption, the time limit, `scancel --signal=TERM --full`): no more
restarts, and while SLURM holds the job RUNNING the signal is passed on to every component's tasks (`job_sigterm`),
since `--full` reaches the batch step alone and every srun here runs in a session of its own (a srun that got it
would SIGKILL its ranks: commands.step_session). A job whose ranks drained on it leaves with DRAINED (75).

`--kill-on-bad-exit=1` on the trainer step: one dead rank ends the step at once, instead of its peers
waiting in a gloo collective for train.dist_timeout_s. `--wait=train.exit_grace_s`, added here to the step's
srun: a rank still running that long after the first clean exit (rank 0's, past the final barrier: the work is
done) is ended by srun, named (`rank_outlived_job`) and the step counts as ended 0: a teardown that hangs (gloo's
process-group destructor, seen once in CI) never holds a finished job.

Off SLURM its twin is rlslurm/local_supervisor.py: submitit's local controller, deciding through `decide` here.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

from rlslurm import events, lifecycle
from rlslurm.errors import SlurmCommandError
from rlslurm.rundir import ENV_VAR, RunDir
from rlslurm.slurm import commands, parse

log = logging.getLogger("rlslurm.slurm.supervisor")

RESTART_ENV = "RLSLURM_TRAINER_RESTART"
"""How many times the trainer ranks were restarted inside this allocation (0: the allocation's first step)."""

NOT_RESTARTED = ("SIGTERM",)
"""Deaths by signal that are not a crash: SLURM (a requeue, a cancel, the time limit) or the hang watchdog
ended the rank, and SLURM is ending the job or the job's own contract decides."""


@dataclass(frozen=True)
class Verdict:
    """What the supervisor does after a trainer step ended."""

    action: Literal["leave", "restart", "requeue"]
    reason: str
    death: parse.TaskEnd | None = None
    """The task whose death ended the step (the first srun reported before it terminated the step)."""


def first_death(ends: Sequence[parse.TaskEnd]) -> parse.TaskEnd | None:
    """The task that ended the step: srun's first report before it terminated the step's other tasks."""
    causes = [e for e in ends if not e.after_step_signal] or list(ends)
    return causes[0] if causes else None


def decide(*, exit_code: int, ends: Sequence[parse.TaskEnd], stopping: bool, job_state: str | None,
           hang: bool, lost: Sequence[dict], restarts: int, max_restarts: int) -> Verdict:
    """Pure: after the trainer step ended with srun's `exit_code` and its task reports `ends`, leave, restart
    the ranks in this allocation, or requeue. `stopping`: SLURM sent this process SIGTERM; `job_state`: component
    0's JobState now; `hang`: the node agent acted on a hang during the step; `lost`: nodes of component 0
    SLURM holds lost (lifecycle.lost_nodes); `restarts`: restarts made in this allocation so far."""
    if exit_code == 0:
        return Verdict("leave", "the trainer step ended 0 (done or drained)")
    death = first_death(ends)
    if stopping or (job_state is not None and job_state != "RUNNING"):
        return Verdict("leave", f"SLURM is ending the job (SIGTERM to the supervisor: {stopping}, state {job_state})",
                       death)
    if hang:
        return Verdict("leave", "the node agent acted on a hang (diag.hang_policy decides what follows)", death)
    if death is None or death.signal is None or death.signal in NOT_RESTARTED:
        how = f"task {death.task} on {death.node}: {death.how}" if death else f"srun exit code {exit_code}"
        return Verdict("leave", f"no trainer rank died by a crash signal ({how}): the job's exit code decides", death)
    if lost:
        nodes = ", ".join(f"{x['node']} ({x['state']})" for x in lost)
        return Verdict("requeue", f"node(s) of component 0 lost: {nodes}", death)
    if restarts >= max_restarts:
        return Verdict("requeue", f"train.max_restarts = {max_restarts} trainer restarts in this allocation spent",
                       death)
    return Verdict("restart", f"rank {death.task} on {death.node} died ({death.how}); restart "
                              f"{restarts + 1} of {max_restarts} in this allocation", death)


class SrunStep:
    """One run of the trainer step: srun's stderr passed through to ours (the batch log) and kept for parsing."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], keep_lines: int = 2000):
        # A session of its own: SLURM's SIGTERM to the batch step must not reach srun, which would SIGKILL the
        # ranks ("forcing job termination") before they drain (commands.step_session; _on_term passes it on).
        self.proc = subprocess.Popen(list(argv), env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                                     **commands.step_session())
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)  # bounded: srun's own lines
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def wait(self) -> tuple[int, str]:
        code = self.proc.wait()
        self._reader.join(timeout=10)
        return code, "".join(self.lines)


def start_components(run: RunDir, job) -> list:
    """Every further component of the het job, one `srun --het-group=N` each, with the job's network
    environment and the GPUs its layout gives it (rlslurm/devices.py); then the lost-node triggers."""
    from rlslurm.devices import component_step
    from rlslurm.layout import JobLayout
    from rlslurm.network import network_env
    from rlslurm.slurm import hetjob, rejoin

    ctx = hetjob.context()
    lay = JobLayout.read(run)
    steps = []
    for comp in ctx.components[1:]:
        role = ROLES[comp.group]
        argv = [sys.executable, "-m", "rlslurm.jobs.entry", "--run-dir", str(run.path), "--role", role]
        srun_args, gpu_env = component_step(lay, comp.group)
        steps.append(hetjob.launch_component(comp.group, argv, output=str(run.logs / f"{role}-%j-%t.log"),
                                             env={**network_env(job.network), **gpu_env},
                                             srun_args=["--open-mode=append", *srun_args]))
        events.emit(run, events.COMPONENT_STARTED, component=comp.group, component_role=role, partition=comp.partition,
                    nodes=list(comp.nodes), job_kind=job.job.kind, srun_args=srun_args)
    if steps:  # a lost node must requeue every component, not only its own (rlslurm/slurm/rejoin.py)
        rejoin.arm(run, ctx.leader_job_id, [c.job_id for c in ctx.components])
    return steps


ROLES = {0: "train", 1: "rollout", 2: "reward"}


def train_nodes(env: dict[str, str] | None = None) -> list[str]:
    """The nodes of component 0 (a plain job's nodes where there is no het job)."""
    e = os.environ if env is None else env
    return parse.expand_nodelist(e.get("SLURM_JOB_NODELIST_HET_GROUP_0") or e.get("SLURM_JOB_NODELIST") or "")


def with_exit_wait(argv: Sequence[str], exit_grace_s: float) -> list[str]:
    """The trainer step's srun argv with `--wait=exit_grace_s` (SLURM's own bound on tasks that outlive the
    first one's exit), unless the argv is not an srun or already says --wait."""
    argv = list(argv)
    if not argv or os.path.basename(argv[0]) != "srun" or any(a.startswith(("--wait", "-W")) for a in argv):
        return argv
    return [argv[0], f"--wait={max(1, int(exit_grace_s))}", *argv[1:]]


class TrainerSupervisor:
    """The loop of the module docstring, for one allocation."""

    def __init__(self, run: RunDir, job, step_argv: Sequence[str], *,
                 show_node: Callable[[str], list[dict]] = commands.show_node):
        self.run, self.job, self.step_argv = run, job, with_exit_wait(step_argv, job.train.exit_grace_s)
        self.show_node = show_node
        self.stopping = False
        self.leader = lifecycle.leader_job_id()
        self.restart_count = lifecycle.restart_count()
        self.allocation_started = time.time()

    def _on_term(self, signum, frame) -> None:
        # SLURM sent SIGTERM to the batch step: a requeue, a preemption or the time limit (which signal the steps
        # too, and SIGKILL after KillWait), or `scancel --signal=TERM --full` (the batch step alone: measured on
        # 22.05, no task gets it, and the sruns, in sessions of their own, do not either). So this process passes
        # it on to every component's tasks while the job runs: every rank and role drains (issue 38). No more
        # restarts.
        log.info("SIGTERM: SLURM is ending or stopping the job; passing it on to every component's tasks; no "
                 "further trainer restarts")
        if not self.stopping:
            # Marked first: a second SIGTERM whose handler runs inside this one's Thread.start (its locks) must
            # not start a relay of its own (rlslurm/lifetime.py StopFlag says why a handler must not wait on a lock).
            self.stopping = True
            threading.Thread(target=self._pass_sigterm_on, name="sigterm-relay", daemon=True).start()

    def _pass_sigterm_on(self) -> None:
        """`scancel --signal=TERM --state=RUNNING <component>` (steps only, never the batch step) of every
        component, while SLURM holds the job running: a job SLURM is requeueing or ending signals its tasks
        itself, and a signal to a job that is pending again (a requeue that went fast) must not touch it."""
        ids = self.component_ids()
        state = self.job_state()
        relayed: dict[str, str] = {}
        for job_id in ids:
            if state not in (None, "RUNNING"):
                relayed[job_id] = f"not needed: SLURM holds the job {state} and signals its tasks itself"
                continue
            try:
                commands.scancel(job_id, signal="TERM", state="RUNNING")
                relayed[job_id] = "signalled"
            except SlurmCommandError as e:  # a job SLURM ends already may refuse it: its tasks have SIGTERM
                relayed[job_id] = f"refused: {e}"
        events.emit(self.run, events.JOB_SIGTERM, role="supervisor", components=ids, relayed=relayed,
                    restart_count=self.restart_count)

    def component_ids(self) -> list[str]:
        """SLURM's id of every component of the job (the leader's alone for a plain job)."""
        from rlslurm.slurm import hetjob

        if "SLURM_HET_SIZE" in os.environ:
            return [c.job_id for c in hetjob.context().components]
        return [self.leader] if self.leader else []

    def _on_usr1(self, signum, frame) -> None:
        # `scancel -b -s USR1` reaches the batch shell only: it asks for the drain, as it did of the bare srun's
        # shell before (whose default action was to die); the ranks' drain gates read the file.
        from rlslurm.diag.drain_gate import request_drain

        log.info("USR1: drain requested (%s)", request_drain(self.run, "SIGUSR1 to the batch shell"))

    def job_state(self) -> str | None:
        try:
            return parse.job_state(commands.show_job(self.leader)) if self.leader else None
        except (SlurmCommandError, parse.SlurmParseError) as e:
            log.warning("job state unknown (%s): taking the job as running", e)
            return None

    def run_forever(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGUSR1, self._on_usr1)
        components = start_components(self.run, self.job) if "SLURM_HET_SIZE" in os.environ else []
        restarts, verdict, code, started = 0, None, 1, time.time()
        try:
            while True:
                started = time.time()
                step = SrunStep(self.step_argv, {**os.environ, RESTART_ENV: str(restarts)})
                code, stderr = step.wait()
                ends = parse.srun_task_ends(stderr)
                if code != 0 and not self.stopping and self._outlived(stderr, ends):
                    code = 0
                hang = any(e.get("t", 0) >= started for e in events.read_events(self.run, events.HANG_DETECTED))
                lost = (lifecycle.lost_nodes(train_nodes(), self.restart_count, self.show_node)
                        if code != 0 and not self.stopping else [])
                verdict = decide(exit_code=code, ends=ends, stopping=self.stopping,
                                 job_state=self.job_state() if code != 0 else None, hang=hang, lost=lost,
                                 restarts=restarts, max_restarts=self.job.train.max_restarts)
                log.info("trainer step ended %d after %.1f s: %s (%s)", code, time.time() - started, verdict.action,
                         verdict.reason)
                if verdict.action == "restart":
                    restarts += 1
                    events.emit(self.run, events.TRAINER_RESTARTED, role="supervisor", **self._death(verdict),
                                trainer_restart=restarts, max_restarts=self.job.train.max_restarts,
                                restart_count=self.restart_count, srun_exit_code=code, step_s=time.time() - started)
                    continue
                if verdict.action == "requeue":
                    self._requeue(verdict, restarts, lost)
                break
        finally:
            if not self._left_to_slurm(verdict, started):
                for comp in components:
                    comp.stop(timeout_s=30)
        if code == 0 and self.stopping and self._drained_on_sigterm():
            # The ranks' own exit is 0 (submitit's), and SLURM would call a job that drained on its SIGTERM without
            # ending it (`scancel --signal=TERM --full`) COMPLETED: the job contract's DRAINED says what it is.
            return lifecycle.ExitCode.DRAINED
        return code

    def _drained_on_sigterm(self) -> bool:
        """Whether the ranks of this allocation drained on SLURM's SIGTERM (its `drained` event)."""
        return any(e.get("signal") == "SIGTERM" and e.get("t", 0) >= self.allocation_started
                   for e in events.read_events(self.run, events.DRAINED))

    def _outlived(self, stderr: str, ends: Sequence[parse.TaskEnd]) -> bool:
        """Whether srun's --wait ended ranks that outlived rank 0's clean exit (then each is named); with
        --kill-on-bad-exit a bad exit ends the step before the wait starts, so `First task exited` is a clean one."""
        wait = parse.srun_wait_expired(stderr)
        bad = {e.task for e in ends if e.task in (wait.exited if wait else ())}
        if wait is None or 0 not in wait.exited or bad or not wait.running:
            return False
        for task in wait.running:
            end = next((e for e in ends if e.task == task), None)
            events.emit(self.run, events.RANK_OUTLIVED_JOB, role="supervisor", rank=task, stuck_rank=task,
                        node=end.node if end else None, grace_s=self.job.train.exit_grace_s,
                        ended=f"srun --wait={wait.after_s}: {end.how if end else 'terminated'}")
        log.warning("ranks %s still ran %d s after rank 0 exited: srun ended them; the step counts as ended 0",
                    list(wait.running), wait.after_s)
        return True

    def _death(self, verdict: Verdict) -> dict:
        d = verdict.death
        assert d is not None
        return {"dead_rank": d.task, "node": d.node, "cause": d.how, "signal": d.signal}

    def _left_to_slurm(self, verdict: Verdict | None, started: float) -> bool:
        """Whether SLURM ends the other components itself: the job is being requeued (drained, past the
        budget) or ended by SLURM. Stopping them here too only kept this process past KillWait."""
        if verdict is None or not self.leader:
            return False
        if verdict.action == "requeue" or self.stopping:
            return True
        return any(e.get("t", 0) >= started for e in events.read_events(self.run, events.DRAINED))

    def _requeue(self, verdict: Verdict, restarts: int, lost: Sequence[dict]) -> None:
        from rlslurm.slurm import rejoin

        death = self._death(verdict)
        # The requeue SIGTERMs every process of the job, and SIGKILLs them KillWait s later: the scontrol
        # children after it (keep_off) must outlive the first signal. An ignored signal stays ignored across
        # exec; this process is leaving anyway.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            done = commands.requeue(self.leader) if self.leader else "no SLURM job id: not requeued"
        except SlurmCommandError as e:
            done = f"failed: {e}"
        failed = list(lost) + [{"node": death["node"], "state": f"trainer rank {death['dead_rank']} died "
                                f"({death['cause']})", "reason": verdict.reason, "restart_count": self.restart_count}]
        failed = [x for i, x in enumerate(failed) if x["node"] not in {y["node"] for y in failed[:i]}]
        # After the requeue: SLURM takes ExcNodeList only from a pending job (rejoin.keep_off says more).
        excluded = rejoin.keep_off(self.run, self.leader, failed) if self.leader else []
        events.emit(self.run, events.TRAINER_RESTARTS_SPENT, role="supervisor", **death, reason=verdict.reason,
                    restarts=restarts, max_restarts=self.job.train.max_restarts, restart_count=self.restart_count,
                    requeue=done, excluded=excluded)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m rlslurm.slurm.supervisor -- SRUN_ARGV...", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(name)s: %(message)s")
    if ENV_VAR not in os.environ:
        # HetSlurmExecutor runs any function, not only rlslurm's jobs: without a run directory there is no
        # config, no budget and nothing to start beside it, so the step runs once, as the bare srun did.
        log.info("%s is not set: running the step once, unsupervised", ENV_VAR)
        return SrunStep(args, dict(os.environ)).wait()[0]
    run = RunDir(Path(os.environ[ENV_VAR]))
    os.environ["RLSLURM_ROLE"] = "supervisor"
    from rlslurm.config import load_config

    return TrainerSupervisor(run, load_config(run.config), args).run_forever()


if __name__ == "__main__":
    sys.exit(main())

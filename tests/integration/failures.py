"""Real runs of every failure `rlslurm diag` names: each function makes its failure happen for real (local
backend: real ranks, engines, reward service; `cluster_*`: the real local Slurm) and returns the run.

    made = reward_down(run_root)         # an RL run whose reward service keeps dying past reward.max_restarts
    made.run                             # its run directory, ready for `rlslurm diag`
    made.close()                         # ends what still runs (only `running` leaves a job alive)

Used by tests/integration/test_diag_causes.py (the two causes that need it: reward service down, weight-sync
verify failure) and by tests/data/diag/record.py, which records each run's events, heartbeats and log tails
under tests/data/diag/<cause>/ for tests/unit/test_diag_recorded.py. Every failure is the real thing, with
two planted facts, both said where they are planted: `env_mismatch` plants an engine fingerprint with
another torch (this machine has one torch, and an engine spawned off SLURM writes no fingerprint);
`sync_failure` corrupts a tensor in flight through the transports' own fault hook (RLSLURM_SYNC_CORRUPT,
rlslurm/sync/buckets.py: the copy on the wire, never the trainer's tensor).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import pytest
import yaml

from rlslurm import events, launch
from rlslurm.config import load_config
from rlslurm.errors import RlslurmError
from rlslurm.jobs.toytrain import FAIL_ENV, SKIP_ENV, STALL_ENV
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.sync.buckets import CORRUPT_ENV
from waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
RL_EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
SFT_EXAMPLE = ROOT / "examples" / "tiny-sft.yaml"
RL_SMALL = ("rl.prompts_per_step=8", "rl.samples_per_prompt=4", "rl.eval_every=100", "task.eval_size=16",
            "checkpoint.interval_steps=1000", "train.steps=6")
"""The RL example from random init, small: a few steps of ~0.2 s after a ~10 s start (engine, reward service)."""
WAIT_S = 240.0
"""Bound on one run, start to end, on 2 shared cores."""
CORRUPTED = "model.layers.1.mlp.up_proj.weight"
"""The tensor `sync_failure` corrupts in flight."""


@dataclass
class Made:
    """A run that failed (or, `running`, still runs) the way its scenario says."""

    run: Path
    slurm: bool = False
    """Whether SLURM ran it (diag then asks SLURM for the job's state)."""
    stops: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for stop in self.stops:
            with contextlib.suppress(Exception):
                stop()


def wait_until(what: str, cond: Callable[[], object], sub: launch.Submission | None = None,
               timeout_s: float = WAIT_S):
    """tests/waiting.py's wait_for, which also gives up as soon as `sub`'s job has ended."""
    def check():
        value = cond()
        if not value and sub is not None and sub.job.done():
            raise AssertionError(f"job {sub.job_id} ended while waiting for {what}; see {sub.run_dir}")
        return value

    return wait_for(what, check, timeout_s)


def submit(config: Path, run_root: Path, overrides: tuple[str, ...] = (), *, env: dict[str, str] | None = None,
           force: bool = False, backend: str = "local") -> launch.Submission:
    """`rlslurm submit CONFIG --set ... [--force]` as a library call, into `run_root`."""
    job = load_config(config, (*overrides, f"cluster.run_root={run_root}"))
    with pytest.MonkeyPatch.context() as mp:  # local tasks inherit the submitter's environment at submit
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        return launch.submit(job, config_text=config.read_text(), backend=backend, force=force)


def ended(sub: launch.Submission, timeout_s: float = WAIT_S) -> str:
    """Wait for the job to end; 'ok' or the failure `--wait` reports."""
    try:
        launch.check_results(sub, launch.wait(sub, timeout_s=timeout_s, poll_s=0.5))
        return "ok"
    except RlslurmError as e:
        return str(e)


def toy_config(path: Path, *, steps: int = 6, step_delay_s: float = 0.05, diag: dict | None = None,
               slurm: dict | None = None, checkpoint_interval: int = 1000) -> Path:
    """The toy job (jobs/toytrain.py), 2 ranks on this machine; with `slurm` (cluster: keys), the spine's het
    job on the local Slurm instead: 1 train node (2 ranks) + 1 rollout node (tests/cluster/spine_util.py).
    Locally with train.max_restarts 0: these scenarios record how a failure ends a run, and the local
    controller would otherwise start crashed ranks again (tests/integration/test_local_trainer_restart.py)."""
    train = {"steps": steps, "step_delay_s": step_delay_s, **({} if slurm is not None else {"max_restarts": 0})}
    data = {"job": {"name": path.stem, "kind": "toy"}, "hardware": {"profile": "cpu", "nodes": 1, "gpus_per_node": 2},
            "placement": {"mode": "colocate"}, "train": train,
            "checkpoint": {"interval_steps": checkpoint_interval, "cost_s": 0.5}}
    if slurm is not None:
        data.update(hardware={"profile": "cpu", "nodes": 2, "gpus_per_node": 2},
                    placement={"mode": "separate", "rollout_nodes": 1},
                    cluster={"backend": "slurm", "run_root": str(path.parent / "runs"), **slurm})
        data["checkpoint"].update(kill_wait_s=5, interval_steps=4)  # the local cluster's KillWait
    if diag:
        data["diag"] = diag
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _steps(run: Path) -> int:
    return max((r.get("step", 0) for r in read_jsonl(run / "metrics.jsonl")), default=0)


def _json(path: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None


def _beat(run: Path, name: str) -> dict:
    """The last heartbeat of process `name` (e.g. train-0, reward-0) of `run`; {} before its first."""
    return _json(run / "heartbeats" / f"{name}.json") or {}


# -- the toy job: finished, exception, hang, running, unknown --------------------------------------------

def finished(root: Path) -> Made:
    sub = submit(toy_config(root / "finished.yaml"), root / "runs")
    assert ended(sub) == "ok"
    return Made(sub.run_dir)


def exception(root: Path) -> Made:
    """Rank 0 raises in the train phase of step 3 (the toy job's RLSLURM_TEST_FAIL_AT_STEP)."""
    sub = submit(toy_config(root / "exception.yaml"), root / "runs", env={FAIL_ENV: "3"})
    assert "RuntimeError: toy fault" in ended(sub)
    return Made(sub.run_dir)


FAST_HANG_FAIL = {"heartbeat_interval_s": 0.2, "hang_timeout_s": 3, "watch_interval_s": 0.25, "hang_policy": "fail",
                  "kill_grace_s": 1.0, "phase_timeouts_s": {"start": 120, "checkpoint": 60}}
"""The diag section of the hang recordings: a 3 s hang timeout, and the hung ranks ended (no requeue)."""


def hang(root: Path) -> Made:
    """Rank 1 stalls in the data phase of step 3 while rank 0 waits in the all-reduce; the node agent dumps
    both and, hang_policy fail, ends them."""
    sub = submit(toy_config(root / "hang.yaml", steps=100, diag=FAST_HANG_FAIL), root / "runs",
                 env={STALL_ENV: "1@3:sleep"})
    assert ended(sub) != "ok"
    return Made(sub.run_dir)


def desync(root: Path) -> Made:
    """Rank 1 skips the loss all_reduce of step 3 (the toy job's RLSLURM_TEST_SKIP_COLLECTIVE): its next
    collective meets rank 0's out of order and both hang inside a collective; the node agent reads both
    flight recorders, names rank 1, the all_reduce and its sequence number, and (policy fail) ends them."""
    sub = submit(toy_config(root / "desync.yaml", steps=100, diag=FAST_HANG_FAIL), root / "runs", env={SKIP_ENV: "1@3"})
    assert ended(sub) != "ok"
    return Made(sub.run_dir)


def running(root: Path) -> Made:
    """A long toy run, left running once both ranks' heartbeats say step >= 3 (`close()` ends it)."""
    sub = submit(toy_config(root / "running.yaml", steps=100_000, step_delay_s=0.2,
                            diag={"heartbeat_interval_s": 0.5}), root / "runs")
    wait_until("the toy run's third step in both heartbeats", lambda: all(
        (_beat(sub.run_dir, f"train-{rank}").get("step") or 0) >= 3 for rank in (0, 1)), sub)
    return Made(sub.run_dir, stops=[lambda: _kill_run(sub.run_dir), sub.job.cancel])


def _kill_run(run: Path, sig: int = signal.SIGKILL) -> list[int]:
    """Signal every process whose heartbeat is in `run` (the ranks, engines, the reward service)."""
    pids = [int(hb["pid"]) for hb in map(json.loads, [p.read_text() for p in (run / "heartbeats").glob("*.json")])]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def unknown(root: Path) -> Made:
    """Both ranks SIGKILLed at once by something outside the job (no event, no traceback, no SLURM): the
    classifier has nothing to go on and must say so."""
    sub = submit(toy_config(root / "unknown.yaml", steps=100_000, step_delay_s=0.2), root / "runs")
    wait_until("the toy run's third step", lambda: _steps(sub.run_dir) >= 3, sub)
    pids = _kill_run(sub.run_dir)
    psutil.wait_procs([p for p in map(_proc, pids) if p], timeout=10)
    assert ended(sub) != "ok"
    return Made(sub.run_dir)


def _proc(pid: int) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid)
    return None


# -- SFT: out of memory --------------------------------------------------------------------------------

def oom(root: Path) -> Made:
    """SFT of a model whose MLP needs 512 GB per matrix, submitted with --force past the plan's OOM verdict:
    torch's CPU allocator refuses it ("DefaultCPUAllocator: can't allocate memory")."""
    sub = submit(SFT_EXAMPLE, root / "runs", ("model.ffn_hidden=2000000000", "train.steps=50"), force=True)
    assert "can't allocate memory" in ended(sub)
    return Made(sub.run_dir)


# -- RL: reward service down, weight-sync verify failure, engine crash, env mismatch ---------------------

def reward_down(root: Path) -> Made:
    """An RL run whose reward service is SIGKILLed after its first step and again once the supervisor has
    restarted it: with reward.max_restarts 1 the supervisor then gives up (reward_service_down) and the
    step fails."""
    sub = submit(RL_EXAMPLE, root / "runs", (*RL_SMALL, "train.steps=200", "reward.service=local",
                                              "reward.max_restarts=1", "reward.health_interval_s=0.2",
                                              "reward.retries=0", "reward.timeout_s=2"))
    run = RunDir(sub.run_dir)
    wait_until("the RL run's first step", lambda: _steps(run.path) >= 1, sub)
    os.kill(_beat(run.path, "reward-0")["pid"], signal.SIGKILL)
    (restarted,) = wait_until("the supervisor's restart", lambda: events.read_events(
        run, events.REWARD_SERVICE_RESTARTED), sub)
    os.kill(restarted["pid"], signal.SIGKILL)
    wait_until("the supervisor to give up", lambda: events.read_events(run, events.REWARD_SERVICE_DOWN), sub)
    assert "RewardServiceError" in ended(sub), f"see {run.path}"
    return Made(run.path)


def sync_failure(root: Path) -> Made:
    """An RL run whose weights arrive corrupted: one tensor's copy on the wire has a flipped bit at every
    UPDATE (RLSLURM_SYNC_CORRUPT), so VERIFY fails, the retry too, and the sync fails the job."""
    sub = submit(RL_EXAMPLE, root / "runs", (*RL_SMALL, "sync.retries=1"), env={CORRUPT_ENV: CORRUPTED})
    assert "SyncVerifyError" in ended(sub), f"see {sub.run_dir}"
    return Made(sub.run_dir)


def env_mismatch(root: Path) -> Made:
    """An RL run (broadcast sync) whose engine says another torch than its trainer: the engine's fingerprint
    is planted (env/rollout-0.json, the train rank's own with torch 2.12.0+cpu; an engine spawned off SLURM
    writes none), and the controller's check before the first sync refuses to broadcast."""
    sub = submit(RL_EXAMPLE, root / "runs", RL_SMALL)
    env = sub.run_dir / "env"
    fp = wait_until("the train rank's env fingerprint", lambda: _json(env / "train-0.json"), sub)
    fp.update(role="rollout", rank=0, torch="2.12.0+cpu")
    (env / "rollout-0.json").write_text(json.dumps(fp, indent=1, sort_keys=True))
    assert "torch differs between train and rollout" in ended(sub), f"see {sub.run_dir}"
    return Made(sub.run_dir)


def engine_crash(root: Path) -> Made:
    """An RL run whose engine process is SIGKILLed after the second step, with no restart to replace it
    (rollout.max_restarts 0: with restarts the lone engine is replaced in the allocation and the run goes on,
    test_engine_failover.py): the controller's next call to it (the rollout, or the sync's DRAIN) is refused,
    and the job fails naming the engine."""
    sub = submit(RL_EXAMPLE, root / "runs", (*RL_SMALL, "train.steps=200", "train.step_delay_s=0.2",
                                              "rollout.max_restarts=0"))
    wait_until("the RL run's second step", lambda: _steps(sub.run_dir) >= 2, sub)
    (engine,) = [p for p in read_jsonl(sub.run_dir / "placement.jsonl") if p["role"] == "rollout"]
    os.kill(engine["pid"], signal.SIGKILL)
    said = ended(sub)
    assert "EngineRequestError" in said or "SyncStageError" in said, f"see {sub.run_dir}: {said}"
    return Made(sub.run_dir)


def engine_hang(root: Path) -> Made:
    """An RL run with one engine whose server is SIGSTOPped after the second step: its supervisor finds no
    healthy /health answer for rollout.hang_timeout_s (3 s here), kills it (engine_unhealthy: engine, node,
    pid, process state stopped); with no restart left (rollout.max_restarts 0: with restarts the lone engine
    is replaced in the allocation and the run goes on) no engine is left, and the job fails naming the engine."""
    sub = submit(RL_EXAMPLE, root / "runs", (*RL_SMALL, "train.steps=200", "train.step_delay_s=0.2",
                                              "rollout.hang_timeout_s=3", "rollout.max_restarts=0"))
    wait_until("the RL run's second step", lambda: _steps(sub.run_dir) >= 2, sub)
    pid = _json(sub.run_dir / "endpoints" / "engine-0.json")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        said = ended(sub)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # its supervisor killed it; never leave a stopped process behind
    assert "EngineRequestError" in said or "SyncStageError" in said, f"see {sub.run_dir}: {said}"
    return Made(sub.run_dir)


# -- the ops kit's own failures: a heartbeat that cannot be written, a node agent that dies ------------------

@contextlib.contextmanager
def read_only(path: Path):
    """Make `path` refuse writes while its files stay readable; yields the errno a write then meets: a
    read-only bind mount over it as root (EROFS: chmod does not stop root), chmod 0500 otherwise (EACCES)."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
            yield errno.EROFS
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
    else:
        path.chmod(0o500)
        try:
            yield errno.EACCES
        finally:
            path.chmod(0o755)


def _long_toy(root: Path, name: str) -> launch.Submission:
    """A toy run of many steps whose step phases time out in 3 s, left running once both ranks beat past step 3."""
    diag = {"heartbeat_interval_s": 0.2, "watch_interval_s": 0.25, "phase_timeouts_s": {"data": 3, "train": 3}}
    sub = submit(toy_config(root / f"{name}.yaml", steps=100_000, step_delay_s=0.2, diag=diag), root / "runs")
    wait_until("the toy run's third step in both heartbeats", lambda: all(
        (_beat(sub.run_dir, f"train-{rank}").get("step") or 0) >= 3 for rank in (0, 1)), sub)
    return sub


def heartbeat_unwritable(root: Path) -> Made:
    """A toy run whose heartbeat directory turns read-only mid-run (`read_only`): both ranks say
    heartbeat_unwritable and train on; recorded past their 3 s phase timeout, with no hang called."""
    sub = _long_toy(root, "heartbeat_unwritable")
    stack = contextlib.ExitStack()
    stack.enter_context(read_only(sub.run_dir / "heartbeats"))
    wait_until("heartbeat_unwritable of both ranks",
               lambda: len(events.read_events(RunDir(sub.run_dir), events.HEARTBEAT_UNWRITABLE)) == 2, sub)
    time.sleep(4)  # past the phase timeout: the agent would have called a hang by now
    assert events.read_events(RunDir(sub.run_dir), events.HANG_DETECTED) == [], f"see {sub.run_dir}"
    return Made(sub.run_dir, stops=[stack.close, lambda: _kill_run(sub.run_dir), sub.job.cancel])


def node_agent(run: Path) -> psutil.Process | None:
    """The node agent (diag/watchdog.py) of `run` on this machine, if one runs."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "rlslurm.diag.watchdog" in cmd and str(run) in cmd:
            return proc
    return None


def agent_died(root: Path) -> Made:
    """A toy run whose node agent is SIGKILLed after the attempt's `start` event: node_agent_died, a new agent
    (diag/agent.py); recorded while the run goes on."""
    sub = _long_toy(root, "agent_died")
    run = RunDir(sub.run_dir)
    first = wait_until("the node agent", lambda: node_agent(sub.run_dir), sub)
    wait_until("the start event", lambda: events.read_events(run, events.START), sub)
    first.send_signal(signal.SIGKILL)
    wait_until("node_agent_died", lambda: events.read_events(run, events.NODE_AGENT_DIED), sub)
    wait_until("a new node agent", lambda: (a := node_agent(sub.run_dir)) is not None and a.pid != first.pid, sub)
    return Made(sub.run_dir, stops=[lambda: _kill_run(sub.run_dir), sub.job.cancel])


# -- a trainer rank that dies without a word; checkpoints: a full disk, a damaged newest one ---------------

def rank_crash(root: Path) -> Made:
    """Trainer rank 1 SIGKILLed from outside past step 3 (as the kernel's OOM killer or a segfault ends a rank:
    no exception, no exit of its own); rank 0 fails in its next all_reduce on the lost peer."""
    sub = submit(toy_config(root / "rank_crash.yaml", steps=100_000, step_delay_s=0.2), root / "runs")
    beat = wait_until("rank 1's third step",
                      lambda: ((b := _beat(sub.run_dir, "train-1")).get("step") or 0) >= 3 and b, sub)
    os.kill(int(beat["pid"]), signal.SIGKILL)
    assert ended(sub) != "ok"
    return Made(sub.run_dir)


@contextlib.contextmanager
def memory_limited(limit_mib: int):
    """A fresh memory cgroup limited to `limit_mib` MiB, swap included (root, a memory controller to write):
    what SLURM's task/cgroup makes of a step's --mem. Yields a function that moves a pid into it."""
    v1 = Path("/sys/fs/cgroup/memory")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"rlslurm-test-oom-{os.getpid()}"
    try:
        group.mkdir()
        limit = limit_mib << 20
        for name, value in (("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit),
                            ("memory.max", limit), ("memory.swap.max", 0)):
            if (group / name).exists():
                (group / name).write_text(str(value))
    except OSError as e:
        pytest.skip(f"an OOM kill is made in a memory cgroup of its own, and none can be made here: {e}")
    try:
        yield lambda pid: (group / "cgroup.procs").write_text(str(pid))
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def oom_kill(root: Path) -> Made:
    """Trainer rank 1 moved, past its second step, into a memory cgroup of 256 MiB; at step 12 it allocates
    1 GiB (RLSLURM_TEST_GROW) and the kernel's OOM killer ends it without a word. The node agent sees it gone
    and reads the cgroup's oom_kill count (diag/deaths.py); rank 0 fails in its next all_reduce."""
    from rlslurm.jobs.toytrain import GROW_ENV

    stack = contextlib.ExitStack()
    move = stack.enter_context(memory_limited(256))
    try:
        sub = submit(toy_config(root / "rank_oom.yaml", steps=100_000, step_delay_s=0.2,
                                diag={"watch_interval_s": 0.25}), root / "runs", env={GROW_ENV: "1@12:1024"})
        beat = wait_until("rank 1's second step",
                          lambda: ((b := _beat(sub.run_dir, "train-1")).get("step") or 0) >= 2 and b, sub)
        move(int(beat["pid"]))
        assert ended(sub) != "ok"
    except BaseException:
        stack.close()
        raise
    return Made(sub.run_dir, stops=[stack.close])


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int):
    """A tmpfs of `size_kib` KiB mounted over the empty directory `path` (root only)."""
    assert not any(path.iterdir()), f"{path} is not empty: a tmpfs over it would hide what is there"
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def disk_full(root: Path) -> Made:
    """A toy run whose checkpoints directory is a 64 KiB tmpfs, mounted right after submit (before the first
    save, seconds later): step 3's save (~36 KB) fits, step 6's meets ENOSPC, which torch.save reports as
    "PytorchStreamWriter failed writing file"; the job fails and step 3's checkpoint stays intact."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is made with a small tmpfs mount, which needs root")
    stack = contextlib.ExitStack()
    sub = submit(toy_config(root / "disk_full.yaml", steps=100, step_delay_s=0.2, checkpoint_interval=3),
                 root / "runs")
    stack.enter_context(small_disk(sub.run_dir / "checkpoints", 64))
    try:
        assert "No space left on device" in ended(sub), f"see {sub.run_dir}"
        assert (sub.run_dir / "checkpoints" / "step-00000003" / "manifest.json").is_file()
    except BaseException:
        stack.close()
        raise
    return Made(sub.run_dir, stops=[stack.close])


def checkpoint_damaged(root: Path) -> Made:
    """A toy run of 6 steps saving every 3, whose newest checkpoint (step 6) then has one byte of its
    weights flipped (as a bad disk or a partial copy leaves it). `rlslurm resume --set train.steps=100000`
    says, on its own output, that it skips step 6 (sha256 mismatch) and resumes from step 3; recorded while
    the resumed run trains past step 4 (`close()` ends it)."""
    from click.testing import CliRunner

    from rlslurm.cli.main import cli

    sub = submit(toy_config(root / "checkpoint_damaged.yaml", steps=6, step_delay_s=0.2, checkpoint_interval=3),
                 root / "runs")
    assert ended(sub) == "ok"
    weights = sub.run_dir / "checkpoints" / "step-00000006" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    resumed_at = time.time()
    said = CliRunner().invoke(cli, ["resume", str(sub.run_dir), "--set", "train.steps=100000"], catch_exceptions=False)
    assert said.exit_code == 0, said.output
    assert "skips checkpoint step-00000006 (step 6): sha256 mismatch in model.safetensors" in said.output, said.output
    assert "resumes from: checkpoint step-00000003 (step 3)" in said.output, said.output
    job_id = re.search(r"submitted local job (\S+)", said.output).group(1)
    wait_until("the resumed run's fourth step", lambda: any(
        r.get("step") == 4 and r["t"] > resumed_at for r in read_jsonl(sub.run_dir / "metrics.jsonl")))
    return Made(sub.run_dir, stops=[lambda: _kill_run(sub.run_dir), lambda: _cancel_local(job_id)])


def _cancel_local(job_id: str) -> None:
    with contextlib.suppress(ProcessLookupError, ValueError):
        os.kill(int(job_id), signal.SIGKILL)  # submitit's local job id is its controller's pid


# -- the local Slurm (tests/data/diag/record.py --cluster starts one): time limit, preemption, node failure --

def _slurm_toy(root: Path, name: str, **kw) -> launch.Submission:
    sub = submit(toy_config(root / f"{name}.yaml", **kw), root / "runs", backend="slurm")
    wait_until(f"job {sub.job_id}'s first step", lambda: _steps(sub.run_dir) >= 1, timeout_s=WAIT_S)
    return sub


def _train_node(run: Path) -> str:
    return [p for p in read_jsonl(run / "placement.jsonl") if p["role"] == "train"][-1]["node"]


def _slurm_state(job_id: str) -> str | None:
    from rlslurm.slurm import commands

    return commands.show_job(job_id)[0].get("JobState")


def time_limit(root: Path) -> Made:
    """A toy job on SLURM whose step (300 s) outlasts its 1-minute allocation: the pre-timeout signal
    cannot be acted on before the time limit, and SLURM kills it (TIMEOUT)."""
    sub = _slurm_toy(root, "time_limit", steps=100, step_delay_s=300, diag={"hang_timeout_s": 900},
                     slurm={"time_limit_min": 1, "signal_before_s": 10})
    wait_until(f"job {sub.job_id} to time out", lambda: _slurm_state(sub.job_id) == "TIMEOUT", timeout_s=180)
    return Made(sub.run_dir, slurm=True)


def preempted(root: Path) -> Made:
    """A toy job on SLURM preempted by a job of the `urgent` partition on its train node (PreemptMode
    REQUEUE): it drains on SIGTERM, SLURM requeues it, and it waits while the urgent job holds the node."""
    from rlslurm.slurm import commands

    sub = _slurm_toy(root, "preempted", steps=100_000, step_delay_s=0.2, slurm={"time_limit_min": 5})
    urgent = commands.sbatch(["--partition=urgent", f"--nodelist={_train_node(sub.run_dir)}", "--ntasks=1",
                              "--time=2", "--job-name=urgent", f"--output={root / 'urgent-%j.out'}", "--wrap=sleep 90"])
    wait_until(f"job {sub.job_id} requeued", lambda: _slurm_state(sub.job_id) == "PENDING", timeout_s=60)
    return Made(sub.run_dir, slurm=True, stops=[lambda: commands.scancel(sub.job_id),
                                                lambda: commands.scancel(urgent)])


def node_failure(root: Path) -> Made:
    """A toy job on SLURM whose train node fails under it: `scontrol update State=DOWN` (what slurmctld
    does to a node that stops answering, without the 5-minute wait); SLURM requeues the job (NODE_FAIL)."""
    from rlslurm.slurm import commands

    sub = _slurm_toy(root, "node_failure", steps=100_000, step_delay_s=0.2, slurm={"time_limit_min": 5})
    node = _train_node(sub.run_dir)
    commands.scontrol("update", f"NodeName={node}", "State=DOWN", "Reason=node_failure scenario")
    wait_until(f"job {sub.job_id} requeued", lambda: _slurm_state(sub.job_id) == "PENDING", timeout_s=60)

    def node_back() -> None:
        commands.scancel(sub.job_id)
        wait_until(f"job {sub.job_id} gone", lambda: _slurm_state(sub.job_id) not in ("PENDING", "COMPLETING"),
                   timeout_s=60)
        commands.scontrol("update", f"NodeName={node}", "State=RESUME")  # ReturnToService=1: DOWN until then

    return Made(sub.run_dir, slurm=True, stops=[node_back])


CLUSTER = {"time_limit": time_limit, "preempted": preempted, "node_failure": node_failure}
"""The causes only SLURM makes: recorded with a local Slurm up (tests/data/diag/record.py --cluster)."""

LOCAL = {"finished": finished, "exception": exception, "hang": hang, "desync": desync, "running": running,
         "unknown": unknown,
         "oom": oom, "reward_down": reward_down, "sync_failure": sync_failure, "env_mismatch": env_mismatch,
         "engine_crash": engine_crash, "engine_hang": engine_hang, "heartbeat_unwritable": heartbeat_unwritable,
         "agent_died": agent_died, "rank_crash": rank_crash, "oom_kill": oom_kill, "disk_full": disk_full,
         "checkpoint_damaged": checkpoint_damaged}
"""Cause (as `rlslurm diag` names it) -> the scenario that makes it happen here."""

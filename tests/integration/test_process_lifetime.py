"""Nothing the job starts outlives its parent (issue 28, case 4; rlslurm/lifetime.py), with real processes.

A parent process (standing in for trainer rank 0) starts a supervised reward service, from its main thread
(the parent-death signal) or from another thread (the getppid watch), and is SIGKILLed: the service, in a
session of its own, ends within seconds instead of running on under init. Its heartbeat stays fresh and
`running` (a SIGKILLed process writes no last word), yet `rlslurm resume` no longer reads it as a sign of
life: its process is gone from this machine.

    python -m pytest -q tests/integration/test_process_lifetime.py      # ~15 s
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from rlslurm import launch, lifetime
from rlslurm.config import load_config
from rlslurm.diag.heartbeat import read_heartbeats
from rlslurm.rundir import RunDir
from waiting import wait_for

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-grpo.yaml"

PARENT = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from rlslurm.reward.config import RewardConfig
    from rlslurm.reward.supervisor import RewardSupervisor
    from rlslurm.rundir import RunDir

    run = RunDir(Path(sys.argv[1])).create()
    def start():
        sup = RewardSupervisor(RewardConfig(service="local", health_interval_s=0.2), run=run)
        sup.start()
        print(sup.proc.pid, flush=True)
    if sys.argv[2] == "main":
        start()
    else:  # a short-lived thread: the kernel's parent-death signal would fire at its end, the watch does not
        t = threading.Thread(target=start)
        t.start()
        t.join()
    time.sleep(600)
""")


def leftovers(run: Path) -> list[str]:
    """This machine's processes whose command line names the run directory."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["cmdline"] and p.info["status"] != psutil.STATUS_ZOMBIE and \
                any(str(run) in arg for arg in p.info["cmdline"]):
            out.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'])}")
    return out


@pytest.mark.parametrize("spawned_from", ["main", "thread"])
def test_a_sigkilled_parent_takes_its_reward_service_along(tmp_path, spawned_from):
    run = tmp_path / "run"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(run), spawned_from], stdout=subprocess.PIPE,
                              text=True)
    try:
        service = int(parent.stdout.readline())
        wait_for("the service's heartbeat", lambda: read_heartbeats(RunDir(run)), 30, poll_s=0.1)
        time.sleep(1.0)  # past the first parent-watch poll: the service is settled, serving
        assert psutil.Process(service).ppid() == parent.pid
        parent.kill()
        killed_at = time.monotonic()
        parent.wait()
    finally:
        if parent.poll() is None:
            parent.kill()
    # Before rlslurm/lifetime.py the service ran on here (parent 1) until the test's own cleanup.
    try:
        wait_for(f"reward service pid {service} to end with its parent", lambda: not leftovers(run), 15, poll_s=0.1)
    finally:
        for line in leftovers(run):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    print(f"\nMEASURE parent SIGKILL ({spawned_from} thread) -> its reward service gone: "
          f"{time.monotonic() - killed_at:.2f} s")


def test_a_fresh_running_heartbeat_of_a_dead_process_is_no_sign_of_life(tmp_path):
    """A SIGKILLed process's last beat says `running` and is a second old: its pid is gone here, so the run is
    resumable at once (the issue: "reward-0 beat 0.3 s ago ... rlslurm drain (or scancel) first")."""
    run = RunDir(tmp_path / "run").create()
    code = ("import os, sys; from pathlib import Path; from rlslurm.diag.heartbeat import HeartbeatWriter; "
            "from rlslurm.rundir import RunDir; "
            "w = HeartbeatWriter(RunDir(Path(sys.argv[1])), 'reward', 0, interval_s=0.1, background=False); "
            "w.update(force=True); os.kill(os.getpid(), 9)")
    done = subprocess.run([sys.executable, "-c", code, str(run.path)], timeout=60)
    assert done.returncode == -signal.SIGKILL
    (hb,) = read_heartbeats(run)
    assert hb["state"] == "running" and time.time() - hb["written"] < 30
    assert launch.signs_of_life(run, load_config(EXAMPLE), hb["written"] + 0.3) is None


def test_child_env_names_this_process_and_its_thread():
    assert lifetime.parse(lifetime.child_env()[lifetime.PARENT_ENV]) == (os.getpid(), True)
    assert lifetime.parse("12:") == (12, False) and lifetime.parse("x") is None and lifetime.parse("") is None

"""A child process of the job ends with the process that started it: nothing the job starts outlives it.

    proc = subprocess.Popen(argv, env={**os.environ, **lifetime.child_env()})   # in the parent
    lifetime.bind_to_parent()                                                   # first thing in the child

Why: a SIGKILLed trainer rank 0 cannot stop what it started. Its reward service (a session of its own, so
its sandboxes can be killed as a group) was reparented to init, out of SLURM's proctrack/linuxproc reach,
and ran on for many minutes after the job COMPLETED, writing a fresh heartbeat that made `rlslurm resume`
refuse the finished run (issue 28, case 4).

`child_env()` names the parent (RLSLURM_PARENT_PID = its pid, and whether the spawning thread is its main
thread); `bind_to_parent()` in the child reads (and removes, so its own children do not inherit a stale
one) that name and:

- sets PR_SET_PDEATHSIG (SIGTERM) when the spawning thread was the parent's main thread. The kernel sends
  that signal when the *thread* that forked the child ends, not the process, so a child started from a
  short-lived thread (an engine supervisor's start in a pool) would be killed when that thread returned:
  there, only the watch below applies;
- checks getppid() once the signal is armed: a parent that died before it was set is not missed (the race
  of prctl's own documentation);
- watches getppid() from a daemon thread every `poll_s`: reparenting (to init or to a subreaper) happens
  only when the parent *process* is gone, whatever thread started the child.

Either way the child gets SIGTERM, so its own clean exit runs (a heartbeat's `exited`, uvicorn's shutdown).
Not a preexec_fn: the parents are threaded, where Python runs no code between fork and exec safely.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

PARENT_ENV = "RLSLURM_PARENT_PID"
"""`<pid>` or `<pid>:main` (spawned from the parent's main thread: the parent-death signal is safe to arm)."""
PR_SET_PDEATHSIG = 1
POLL_S = 0.5
"""Seconds between the watch's getppid() checks: how late a child started from a thread notices."""
UNCAPPED_ENV = "RLSLURM_UNCAPPED_CGROUP"
"""Set by a memory-capped trainer rank (rlslurm/memcap.py) for what it starts: the cgroup it left."""
KILL_AFTER_S = 30.0
"""Seconds the watch gives this process's own SIGTERM handling before SIGKILL (SLURM's KillWait, say)."""


def child_env() -> dict[str, str]:
    """The environment entry a child started from here needs for `bind_to_parent`."""
    main = threading.current_thread() is threading.main_thread()
    return {PARENT_ENV: f"{os.getpid()}{':main' if main else ''}"}


def parse(value: str) -> tuple[int, bool] | None:
    """Pure: (parent pid, spawned from its main thread) of PARENT_ENV's value, None when malformed."""
    pid, _, where = value.partition(":")
    try:
        return int(pid), where == "main"
    except ValueError:
        return None


def arm_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) for this process (Linux); False where it cannot be set."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def bind_to_parent(sig: int = signal.SIGTERM, poll_s: float = POLL_S) -> int | None:
    """End this process (`sig` to itself) when the parent named by PARENT_ENV is gone, as the module says.
    Returns the parent's pid, or None when no parent was named (started by hand: nothing to bind to)."""
    named = parse(os.environ.pop(PARENT_ENV, ""))
    if named is None:
        return None
    parent, main_thread = named
    if main_thread:
        arm_parent_death_signal(sig)
    if os.getppid() != parent:  # it died before the signal was armed (or before this process ran at all)
        log.warning("parent pid %d is gone before this process (%d) started: exiting", parent, os.getpid())
        os.kill(os.getpid(), sig)
        return parent

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(poll_s)
        log.warning("parent pid %d is gone (now parent %d): ending this process (%d)", parent, os.getppid(),
                    os.getpid())
        os.kill(os.getpid(), sig)
        # A handler that drains (the engine finishing its requests) gets KILL_AFTER_S; one that never ends, no more.
        threading.Event().wait(KILL_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return parent


def process_age_s(pid: int | str = "self") -> float:
    """Seconds since process `pid` started, to the kernel's clock tick (/proc/<pid>/stat's start time against
    /proc/uptime). psutil's create_time adds the boot time, which /proc/stat rounds to a whole second: an age from it
    is off by up to a second, as much as a start-up figure of a few seconds can afford."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")


def leave_parent_cap() -> None:
    """In a process a memory-capped trainer rank started (its engines, the reward service): go back to the cgroup
    the rank left, before anything is imported (rlslurm/__init__.py calls it). Their memory is their own, as an
    engine's on another GPU is, not the rank's: a child inherits its parent's cgroup, and the pages a process
    takes stay charged where it took them. The variable is removed, so what this process starts stays here too."""
    base = os.environ.pop(UNCAPPED_ENV, None)
    if base:
        try:
            with open(os.path.join(base, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:  # the rank's cap then holds this process too: say so, do not fail the process
            log.warning("could not leave the capped rank's memory cgroup for %s: %s", base, e)


class StopFlag:
    """A stop request that a signal handler may raise: threading.Event's interface, without its lock.

    Why not an Event: `Event.set` takes the Event's lock, and a Python signal handler runs in the main thread
    between two bytecodes, maybe while that thread holds the same lock (inside the Event's own wait, or the set
    of an earlier signal's handler): it then waits for itself for good. Seen: a burst of SIGTERMs left 2 of 10
    node agents hung with their run gone (bench/run_all.py's requeue bench left one behind;
    tests/unit/test_stop_flag.py). `set` stores a bool; `wait` sleeps in slices of `poll_s` and reads it."""

    def __init__(self, poll_s: float = 0.1):
        self.poll_s = poll_s
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False when `timeout` seconds passed first (None: wait until set)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = self.poll_s if deadline is None else min(self.poll_s, deadline - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)
        return True

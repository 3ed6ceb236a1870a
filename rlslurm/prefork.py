"""Ranks and engines forked from a process that imported torch and transformers once (the local backend).

    prefork.preload(env)                                   # the local supervisor, once, before its first start
    task = prefork.fork_module("submitit.core._submit", [folder], env, stdout, stderr)   # Popen's interface
    prefork.plant()                                        # trainer rank 0, first thing: a copy of itself, waiting
    proc = prefork.grow("rlslurm.rollout.server", argv, env, log)   # spawn_engine: that copy runs the server

Why (issue 36): every rank and engine of the local backend is a Python process that imports torch and
transformers first, ~3.3 s of one core each on this machine; three of them importing at once on 2 cores took the
engine, the first step's critical path, 6.3 s. And each pays the imports' memory again: torch's relocated library
data and the modules' objects are ~150-170 MB of private pages per process. Forked from a process that imported
them, a child starts with them and shares those pages copy-on-write.

What makes it safe, and what it replaces of a fresh interpreter: the parent forks while it runs one Python thread
(the supervisor's poll loop; rank 0 before it starts any), with no CUDA initialised (only imports); the child gets
the environment, stdout / stderr, signal dispositions, logging and atexit state a fresh `python -u -m module` would
have, and ends as the interpreter would (non-daemon threads joined, its own atexit handlers, streams flushed), but
never runs its parent's handlers. What a library read from the environment at load (libgomp's OMP_WAIT_POLICY,
OMP_NUM_THREADS) is the preloader's: `preload` takes the engines' (rlslurm/rl/engines.py `preload_env`); the ranks
set their threads through torch.

Hand-written because no kept library forks a *module run* with a fresh process's state: multiprocessing's
forkserver runs pickled callables sent over a socket, and its children are the server's, not the caller's.
A planted copy (rank 0's engine) is the same fork made early and told later, over a pipe of its own, which module
to run: JSON (argv, environment, log path), never pickle.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import importlib.util
import io
import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence

log = logging.getLogger(__name__)

PREFORKED_ENV = "RLSLURM_PREFORKED"
"""Set in a child `fork_module` made: torch and transformers came with the fork (rank 0 may then `plant`)."""
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "safetensors.torch")
"""What every rank and hf engine imports first, and the preloader imports once for them."""
MAX_REQUEST_BYTES = 1 << 20
"""A planted copy's one request (argv, environment, log path) is at most this long."""

_preloaded: list[str] = []  # what `preload` imported (its forks start with them)
_seed: "_Seed | None" = None


def preload(env: dict[str, str] | None = None, also: Sequence[str] = ()) -> float:
    """Import PRELOAD and `also` (the job's own entrance) in this process, after setting `env` (what libraries read
    at load); returns the seconds."""
    started = time.monotonic()
    os.environ.update(env or {})
    for name in (*PRELOAD, *also):
        __import__(name)
    # The imports' objects out of the collector's reach: a collection in a child writes to every object it
    # visits, and each page it writes to is copied out of the shared ones (CPython's gc.freeze, for forks).
    gc.collect()
    gc.freeze()
    _preloaded[:] = [*PRELOAD, *also]
    return time.monotonic() - started


def preloaded() -> bool:
    """Whether this process imported PRELOAD through `preload` (its forks start with them)."""
    return bool(_preloaded)


class ForkedProcess:
    """A child this process forked, with the part of subprocess.Popen's interface the job's supervisors use."""

    def __init__(self, pid: int, args: Sequence[str]):
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere (a subreaper's sweep): its code is lost, it ended
                    self.returncode = -signal.SIGKILL
                    return self.returncode
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_module(module: str, args: Sequence[str], env: dict[str, str], stdout, stderr,
                unbuffered: bool = True) -> ForkedProcess:
    """`python [-u] -m module *args` with `env`, stdout and stderr (open files), as a fork of this process."""
    out, err = stdout.fileno(), stderr.fileno()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _run_child(module, list(args), {**env, PREFORKED_ENV: "1"}, out, err, unbuffered)
    return ForkedProcess(pid, [sys.executable, "-m", module, *args])


def _run_child(module: str, args: list[str], env: dict[str, str], out: int, err: int, unbuffered: bool) -> None:
    code = 1
    try:
        _title([sys.executable, *(["-u"] if unbuffered else []), "-m", module, *args])
        _fresh_process_state(env, out, err, unbuffered)
        # Its log says how it started: a stack or a timing read later is of a fork, not of a fresh interpreter.
        print(f"rlslurm.prefork: pid {os.getpid()} runs {module}, forked from pid {os.getppid()} with "
              f"{', '.join(_preloaded or PRELOAD)} imported there", file=sys.stderr, flush=True)
        # What `python -m module` gives: argv[0] the module's file (during the run and after it, at exit).
        spec = importlib.util.find_spec(module)
        sys.argv = [spec.origin if spec is not None and spec.origin else module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:  # what the interpreter does with an uncaught one: die of SIGINT
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: B036 - the child's last word, as the interpreter would print it
        traceback.print_exc()
    _finish()
    os._exit(code)


def ready_titles() -> None:
    """First thing in a process that will fork (the local supervisor): setproctitle finds this process's argv
    memory from its environment, which must not have been changed yet; its forks inherit what it found."""
    import setproctitle

    setproctitle.getproctitle()


def _title(argv: Sequence[str]) -> None:
    """ps and /proc/<pid>/cmdline show the command this fork stands for, not the parent's (where `ready_titles`
    ran in the forking line; elsewhere this does nothing)."""
    import setproctitle

    setproctitle.setproctitle(" ".join(argv))


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """The interpreter's own end, in the child: its non-daemon threads, its atexit handlers, its streams."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # noqa: SLF001 - what Py_FinalizeEx calls first
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


def _fresh_process_state(env: dict[str, str], out: int, err: int, unbuffered: bool) -> None:
    """What a new interpreter would have: env, stdio, default signal handlers, bare logging, no atexit handlers."""
    os.environ.clear()
    os.environ.update(env)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    atexit._clear()  # noqa: SLF001 - the parent's handlers are the parent's
    from rlslurm import lifetime

    lifetime.leave_parent_cap()  # what rlslurm's import does in a fresh process (rlslurm/__init__.py)
    # A fresh interpreter runs the site hooks with its own environment (coverage's subprocess hook, a test's
    # hold at exit): they ran in the parent with the parent's.
    for hook in ("sitecustomize", "usercustomize"):
        if hook in sys.modules:
            with contextlib.suppress(Exception):
                importlib.reload(sys.modules[hook])


# -- rank 0's planted copy: the engine's process, forked before the rank starts its threads -------------------------

class _Seed:
    def __init__(self, pid: int, write_fd: int):
        self.pid, self.write_fd = pid, write_fd


def plant() -> bool:
    """In a preforked rank (PREFORKED_ENV), while it runs one thread: fork a copy that waits for `grow`'s request.
    True when planted; a copy never grown exits when this process closes the pipe (`discard`, or its exit)."""
    global _seed
    if _seed is not None or os.environ.get(PREFORKED_ENV) != "1" or threading.active_count() > 1:
        return False
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(write_fd)
        # The run directory in its title too: what lists a run's processes (tests/integration/procs.py) finds it.
        _title([sys.executable, "-m", "rlslurm.prefork", "--planted-by", str(os.getppid()), "--run-dir",
                os.environ.get("RLSLURM_RUN_DIR", "")])
        request = _read_request(read_fd)
        if request is None:
            os._exit(0)
        with open(request["log"], "ab") as logf:
            _run_child(request["module"], request["args"], request["env"], logf.fileno(), logf.fileno(), True)
    os.close(read_fd)
    os.set_inheritable(write_fd, False)
    _seed = _Seed(pid, write_fd)
    return True


def _read_request(fd: int) -> dict | None:
    data = b""
    while len(data) <= MAX_REQUEST_BYTES:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    os.close(fd)
    if not data or len(data) > MAX_REQUEST_BYTES:
        return None
    try:
        request = json.loads(data)
    except ValueError:
        return None
    return request if isinstance(request, dict) and {"module", "args", "env", "log"} <= request.keys() else None


def grow(module: str, args: Sequence[str], env: dict[str, str], log_path: str) -> ForkedProcess | None:
    """Hand the planted copy its module, argv, environment and log (stdout and stderr); None when none is
    planted (then the caller starts a process of its own). One use: a restart starts a fresh process."""
    global _seed
    seed, _seed = _seed, None
    if seed is None:
        return None
    data = json.dumps({"module": module, "args": list(args), "env": env, "log": str(log_path)}).encode()
    if len(data) > MAX_REQUEST_BYTES:
        _seed = seed
        discard()
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(seed.write_fd, view):]
    finally:
        os.close(seed.write_fd)
    return ForkedProcess(seed.pid, [sys.executable, "-m", module, *args])


def discard() -> None:
    """The planted copy is not needed (no engine to spawn here): it reads the closed pipe and exits."""
    global _seed
    seed, _seed = _seed, None
    if seed is not None:
        os.close(seed.write_fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(seed.pid, 0)

"""Stack dumps of live processes: py-spy first, faulthandler as the fallback, and what the stack shows.

    dump = dump_stack(pid, native=True, timeout_s=20)
    dump.text, dump.method, dump.state        # "py-spy --native", "running" ...
    collective_in(dump.text)                  # "all_reduce" when the rank waits in a collective

The order of attempts, and why:
1. `py-spy dump --native --pid P`: Python and C/C++ frames (shows a gloo/NCCL wait under all_reduce).
   It attaches with ptrace and pauses the process for a few milliseconds.
2. `py-spy dump --pid P`: Python frames only, where native unwinding fails (stripped libraries).
3. A process that is stopped (SIGSTOP, state T) cannot be paused again by py-spy ("Failed to suspend
   process"); it is already still, so `py-spy dump --nonblocking` reads its memory consistently.
4. Where ptrace is not allowed at all (no CAP_SYS_PTRACE, Yama), the process dumps itself: the phase
   guard registers `faulthandler` on FAULTHANDLER_SIGNAL writing into <run>/stacks/faulthandler-*.txt,
   and we send that signal and read what was appended. faulthandler's handler is C code that walks the
   thread states without taking the GIL, so it works while the process sits in C code or holds the GIL.

FAULTHANDLER_SIGNAL is SIGURG: the drain gate owns SIGUSR1 and SIGTERM, submitit owns SIGUSR2, and
SIGURG's default action is "ignore", so a process that never registered the handler is not killed.
"""

from __future__ import annotations

import faulthandler
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

import psutil

FAULTHANDLER_SIGNAL = signal.SIGURG

# torch.distributed's Python-level collectives (distributed_c10d.py) and the C++ waits beneath them.
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_object", "all_gather",
                "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "all_to_all",
                "broadcast_object_list", "broadcast", "monitored_barrier", "barrier", "reduce",
                "gather", "scatter", "send", "recv", "isend", "irecv")
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>[\w<>.:~]+) \((?P<file>[^:()]+)(?::(?P<line>\d+))?\)")
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>[\w<>.]+)')
_NATIVE_WAIT = re.compile(r"(gloo::|c10d::|ncclKernel|nccl\w*Wait|ProcessGroupNCCL|ProcessGroupGloo|TCPStore)")
# DDP all-reduces gradient buckets from C++ inside backward(): no Python all_reduce frame, but the main
# thread waits in the reducer (or, with NCCL/gloo, in their allreduce), so the native frames name it.
_NATIVE_ALL_REDUCE = re.compile(r"c10d::Reducer::|gloo::\w*[Aa]llreduce|nccl\w*All[Rr]educe")


@dataclass
class StackDump:
    pid: int
    text: str
    method: str
    """Which attempt produced `text`: py-spy --native, py-spy, py-spy --nonblocking, faulthandler, none."""
    state: str
    """psutil's process status at the time of the dump: running, sleeping, stopped, ..."""


def py_spy_binary() -> str | None:
    """py-spy on PATH, else beside this interpreter (a venv that was not activated)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else None


def register_faulthandler(path: Path) -> TextIO:
    """Make this process write all its threads' stacks to `path` on FAULTHANDLER_SIGNAL; keep the file open."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")
    faulthandler.register(FAULTHANDLER_SIGNAL, file=f, all_threads=True, chain=False)
    return f


def process_state(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


def _py_spy(pid: int, extra: list[str], timeout_s: float) -> tuple[bool, str]:
    binary = py_spy_binary()
    if binary is None:
        return False, "py-spy not found on PATH"
    try:
        done = subprocess.run([binary, "dump", "--pid", str(pid), *extra], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"py-spy {' '.join(extra)} timed out after {timeout_s:.0f} s"
    if done.returncode == 0 and "Thread" in done.stdout:
        return True, done.stdout
    err = (done.stderr or done.stdout).strip().splitlines()
    return False, f"py-spy {' '.join(extra)} exit {done.returncode}: {err[0] if err else ''}"


def _faulthandler(pid: int, file: Path, timeout_s: float, sleep: Callable[[float], None]) -> tuple[bool, str]:
    try:
        before = file.stat().st_size if file.exists() else 0
        psutil.Process(pid).send_signal(FAULTHANDLER_SIGNAL)
    except (OSError, psutil.Error) as e:
        return False, f"faulthandler signal failed: {e}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # polled: the handler runs when the target is next scheduled
        sleep(0.05)
        if file.exists() and file.stat().st_size > before:
            sleep(0.1)  # let the handler finish writing every thread
            with open(file) as f:
                f.seek(before)
                return True, f.read()
    return False, f"no faulthandler output in {file} within {timeout_s:.0f} s"


def dump_stack(pid: int, *, native: bool = True, timeout_s: float = 20.0,
               faulthandler_file: Path | None = None, use_py_spy: bool = True,
               sleep: Callable[[float], None] = time.sleep) -> StackDump:
    """Dump the stacks of all threads of `pid`, trying the methods of the module docstring in order."""
    state = process_state(pid)
    tried: list[str] = []
    if use_py_spy:
        if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            attempts = [("py-spy --nonblocking", ["--nonblocking"])]
        else:
            attempts = ([("py-spy --native", ["--native"])] if native else []) + [("py-spy", [])]
        for method, extra in attempts:
            ok, text = _py_spy(pid, extra, timeout_s)
            if ok:
                return StackDump(pid, text, method, state)
            tried.append(text)
    if faulthandler_file is not None and state not in (psutil.STATUS_STOPPED, "gone"):
        ok, text = _faulthandler(pid, faulthandler_file, timeout_s, sleep)
        if ok:
            return StackDump(pid, text, "faulthandler", state)
        tried.append(text)
    return StackDump(pid, "no stack: " + "; ".join(tried or ["nothing tried"]) + "\n", "none", state)


def frames(text: str) -> list[tuple[str, str, str | None]]:
    """(function, file, line) of every frame in a py-spy or faulthandler dump, innermost first."""
    out = []
    for line in text.splitlines():
        m = _PYSPY_FRAME.match(line) or _FAULTHANDLER_FRAME.match(line)
        if m:
            out.append((m["func"], m["file"], m["line"]))
    return out


def collective_in(text: str) -> str | None:
    """The torch.distributed collective a dump waits in (`all_reduce`, `barrier`, ...), or None."""
    for func, file, _ in frames(text):
        name = func.rsplit(".", 1)[-1]
        if name in _COLLECTIVES and ("distributed" in file or "c10d" in file):
            return name
    if _NATIVE_ALL_REDUCE.search(text):
        return "all_reduce"
    if _NATIVE_WAIT.search(text):
        return "collective"
    return None


def top_frame(text: str, skip_files: tuple[str, ...] = ("threading.py",)) -> str | None:
    """The innermost frame of the main thread that is the program's own code, as `func (file)`."""
    for func, file, line in frames(text):
        python_code = file.endswith(".py") or file.startswith("<")  # native frames name a .so
        if python_code and not any(s in file for s in skip_files):
            return f"{func} ({file}:{line})" if line else f"{func} ({file})"
    return None

"""The code scorer's sandbox: model-written programs are hostile, so each runs bounded and alone.

    sandbox = Sandbox(SandboxConfig(), slots=8)
    result = await sandbox.execute("print(1 + 1)")       # SandboxResult(status="ok", stdout=b"2\\n", ...)

One process per execution, started by plain execs (no preexec_fn: the service is threaded and asyncio,
where forking Python code is unsafe):

    unshare --net [--user]       an empty network namespace: not even loopback is up
      bwrap ...                  bubblewrap: the other namespaces, the filesystem view, the seccomp filter
        prlimit --cpu --as --nproc --fsize --nofile --core=0
          setpriv --reuid=U ...  mode root: an unprivileged uid of its own per slot, no capabilities
            python3 -I -S main.py

Bubblewrap (Debian's `bubblewrap`, Flatpak's sandbox) builds, in a fresh mount namespace, a new root
on an empty tmpfs and pivots into it. Why it and not util-linux mounts in a shell: it is the kept tool
for exactly this (one process does every mount, the pivot, the capability drop), it takes a seccomp
program on a file descriptor, so no launcher of ours runs inside, and it is cheaper than the shell's
fork + exec per mount was. The program's whole filesystem is:

    /usr                 the host's, read-only and nosuid (the interpreter and its standard library)
    /bin /lib /lib64 ... as on the host: symlinks into /usr, or read-only binds
    /etc/ld.so.cache     read-only; nothing else of /etc
    /proc                of its own pid namespace
    /dev                 null zero full random urandom, fd links; /dev/shm points at /tmp
    /tmp                 its working dir: a tmpfs of `disk_mb`, the one writable mount, so the total
                         it can write; the program arrives there as main.py through a file descriptor
    /                    read-only

and nothing else: no host socket (munge, dbus, a container runtime), no /run, /var or home, no project
files, no run directory, no staging path. Its process is pid 1 of a pid namespace: when it ends, the
kernel kills every process it left behind, even those that setsid()'d out of its process group; it
also has ipc, uts and cgroup namespaces of its own. bwrap sets no_new_privs (a setuid binary gains
nothing; /usr is nosuid besides) and loads the seccomp filter of `syscall_filter.py` just before its
exec; the capability sets end empty (bounding, permitted, effective, inheritable, ambient). bwrap
--die-with-parent: a SIGKILLed service leaves no execution running.

mode root (the service runs as root): bwrap runs privileged, without a user namespace, and keeps
only CAP_SETUID/SETGID/SETPCAP for setpriv, which drops to uid `uid_base + slot` and clears the
bounding and inheritable sets (the uid change clears the rest). Why a uid per slot: RLIMIT_NPROC
does not bind for root and counts *per uid*, so only a uid of its own makes a fork bomb hit its limit
without starving other slots.

mode userns (not root, e.g. a SLURM job as a user): an unprivileged user namespace (uid `uid_base +
slot` inside, the service's uid outside; a root service drops to that uid first), no capabilities;
the kernel counts RLIMIT_NPROC per user namespace, so the process limit binds per execution here too.

When neither works here (no bubblewrap, no libseccomp, namespaces refused), `require_isolation`
decides: refuse (default) or run with rlimits only, in a host temp dir.

Every execution has a wall timeout after which its namespace (and so every process in it) is killed,
and stdout and stderr are read up to `output_kb` each: one byte more and it is killed (output_limit).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from rlslurm.errors import RewardServiceError
from rlslurm.reward.config import SandboxConfig

log = logging.getLogger(__name__)

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
Status = Literal["ok", "failed", "timeout", "output_limit", "signal"]

# Top-level host paths the interpreter may live under (merged-/usr systems make the others symlinks).
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")
# Capabilities bwrap (mode root) keeps across its exec, for setpriv alone: it changes uid and group
# and empties the bounding set, and the uid change clears permitted, effective and ambient.
_SETPRIV_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")


@dataclass(frozen=True)
class SandboxResult:
    """What one execution did; `reason` is one line a human reads in the reward log."""

    status: Status
    exit_code: int | None
    signal: str | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    reason: str

    @property
    def passed(self) -> bool:
        return self.status == "ok"


@functools.cache
def detect_mode(requested: str = "auto") -> str:
    """The isolation that works on this machine: root, userns or none (probed once per process)."""
    for mode in _candidates(requested):
        problem = _probe(mode)
        if problem is None:
            return mode
        log.warning("sandbox mode %s unavailable: %s", mode, problem)
    return "none"


def _candidates(requested: str) -> list[str]:
    return {"auto": ["root", "userns"] if os.geteuid() == 0 else ["userns"]}.get(requested, [requested])


@functools.cache
def _probe(mode: str) -> str | None:
    """Why `mode` does not work here, or None: one real execution of a program that prints "ok"."""
    if mode == "root" and os.geteuid() != 0:
        return "the service does not run as root"
    missing = [tool for tool in ("unshare", "bwrap", "prlimit", "setpriv")
               if shutil.which(tool, path=SAFE_PATH) is None]
    if missing:
        return f"{', '.join(missing)} not on {SAFE_PATH} (Debian: util-linux, bubblewrap)"
    python = shutil.which("python3", path=SAFE_PATH)
    if python is None:
        return f"no python3 on {SAFE_PATH}"
    try:
        bpf = _seccomp_program()
    except (ImportError, OSError, AttributeError) as e:
        return f"no seccomp filter: {e} (PyPI: pyseccomp; Debian: libseccomp2)"
    fds = [_memfd("seccomp", bpf), _memfd("main.py", b"print('ok')\n")]
    try:
        done = subprocess.run(_command(mode, SandboxConfig(), SandboxConfig().uid_base, python, *fds),
                              capture_output=True, timeout=10, pass_fds=fds, env={"PATH": SAFE_PATH})
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        for fd in fds:
            os.close(fd)
    if done.returncode != 0 or done.stdout != b"ok\n":
        return f"exit {done.returncode}: {done.stderr.decode(errors='replace').strip()[-300:]}"
    return None


def _seccomp_program() -> bytes:
    from rlslurm.reward.syscall_filter import sandbox_filter_bpf

    return sandbox_filter_bpf()


def _memfd(name: str, data: bytes) -> int:
    """An anonymous file holding `data`, read from its start by bwrap (never a path on the host)."""
    fd = os.memfd_create(name)
    try:
        _write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@functools.cache
def _system_dirs_argv() -> tuple[str, ...]:
    """/usr read-only, and /bin, /lib, ... as the host has them: symlinks into /usr, or read-only binds."""
    argv = []
    for top in _SYSTEM_DIRS:
        host = f"/{top}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    return tuple(argv)


def _view_argv(disk_mb: int, program_fd: int) -> list[str]:
    """bwrap's arguments for the filesystem the program sees (the module docstring draws it)."""
    argv = list(_system_dirs_argv())
    # bwrap makes the parents of a bind 0700: /etc must be searchable for the dropped uid's loader.
    argv += ["--perms", "0755", "--dir", "/etc", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
             "--proc", "/proc", "--dir", "/dev"]
    for dev in _DEVICES:
        argv += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    argv += ["--symlink", "/proc/self/fd", "/dev/fd"]
    for n, name in enumerate(("stdin", "stdout", "stderr")):
        argv += ["--symlink", f"/proc/self/fd/{n}", f"/dev/{name}"]
    # POSIX shared memory and semaphores (multiprocessing) live in /dev/shm: pointing it into the work
    # dir keeps one writable mount, so disk_mb bounds everything the program can write.
    argv += ["--symlink", "/tmp", "/dev/shm",
             "--size", str(disk_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
             "--perms", "0644", "--file", str(program_fd), "/tmp/main.py", "--chdir", "/tmp",
             "--remount-ro", "/"]
    return argv


def _command(mode: str, c: SandboxConfig, uid: int, python: str, seccomp_fd: int, program_fd: int) -> list[str]:
    """The exec chain of one execution in mode root or userns (the module docstring explains each step)."""
    limits = [f"--cpu={c.cpu_s}", f"--as={c.mem_mb << 20}", f"--fsize={c.fsize_mb << 20}", f"--nofile={c.nofile}",
              f"--nproc={c.nproc}", "--core=0"]
    # bwrap brings loopback up in a network namespace it makes; `unshare --net` leaves the new one bare,
    # so nothing answers even on 127.0.0.1 (and a program cannot listen there for its own children).
    if mode == "root":
        outer = ["unshare", "--net", "--"]
        who = ["--cap-drop", "ALL", *(a for cap in _SETPRIV_CAPS for a in ("--cap-add", cap))]
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "--"]
    else:
        # The outer user namespace owns the bare network namespace; bwrap's own, inside it, maps the
        # slot uid (the outer one maps only its root). A root service that asks for this mode drops to
        # the slot uid first: no process of the execution is root on the host, and RLIMIT_NPROC binds.
        outer = ["unshare", "--user", "--map-root-user", "--net", "--"]
        if os.geteuid() == 0:
            outer = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *outer]
        who = ["--unshare-user", "--uid", str(uid), "--gid", str(uid), "--cap-drop", "ALL"]
        drop = []
    bwrap = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try", "--hostname",
             "sandbox", "--die-with-parent", "--new-session", "--as-pid-1", *who, "--seccomp", str(seccomp_fd),
             *_view_argv(c.disk_mb, program_fd)]
    return [*outer, *bwrap, "--", "prlimit", *limits, "--", *drop, python, "-I", "-S", "main.py"]


class Sandbox:
    """Runs Python programs under the limits of `cfg`, at most `slots` at once (one uid per slot)."""

    def __init__(self, cfg: SandboxConfig, slots: int, root: str | Path | None = None):
        self.cfg = cfg
        self.mode = detect_mode(cfg.mode)
        if self.mode == "none" and cfg.require_isolation:
            problems = "; ".join(f"{m}: {_probe(m)}" for m in _candidates(cfg.mode))
            raise RewardServiceError(
                f"reward.sandbox: no isolation works here (mode {cfg.mode!r}; {problems}); install bubblewrap, "
                "util-linux and libseccomp2 (sbatch/install.sh does), or set reward.sandbox.require_isolation "
                "= false to run model-written code with rlimits only")
        python = shutil.which(cfg.python, path=SAFE_PATH)
        if python is None:
            raise RewardServiceError(f"reward.sandbox.python = {cfg.python!r} is not on {SAFE_PATH}")
        real = os.path.realpath(python)
        if self.mode != "none" and real.split("/")[1] not in _SYSTEM_DIRS:
            raise RewardServiceError(
                f"reward.sandbox.python = {cfg.python!r} is {real}: the sandbox shows only "
                f"{', '.join('/' + d for d in _SYSTEM_DIRS)} of the host; install the interpreter under /usr")
        self.python = python
        self._seccomp = _seccomp_program() if self.mode != "none" else b""
        # Mode none only: a host dir per execution (the isolated modes have no host path at all).
        self.root = Path(tempfile.mkdtemp(prefix="rlslurm-sandbox-", dir=root))
        self._free = asyncio.Queue()
        for slot in range(slots):
            self._free.put_nowait(cfg.uid_base + slot)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    async def execute(self, program: str, stdin: bytes = b"") -> SandboxResult:
        """Run `program` once, bounded; waits for a free slot first."""
        uid = await self._free.get()
        try:
            return await self._run(program, stdin, uid)
        finally:
            self._free.put_nowait(uid)

    async def _run(self, program: str, stdin: bytes, uid: int) -> SandboxResult:
        c = self.cfg
        env = {"PATH": SAFE_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        work, fds = None, []
        if self.mode == "none":
            work = Path(tempfile.mkdtemp(dir=self.root))
            (work / "main.py").write_text(program)
            env.update(HOME=str(work), TMPDIR=str(work))
            # setpriv --pdeathsig: a SIGKILLed service must not leave "sleep forever" running.
            argv = ["setpriv", "--pdeathsig", "KILL", "--", "prlimit", f"--cpu={c.cpu_s}", f"--as={c.mem_mb << 20}",
                    f"--fsize={c.fsize_mb << 20}", f"--nofile={c.nofile}", "--core=0", "--", self.python, "-I", "-S",
                    "main.py"]
        else:
            fds = [_memfd("seccomp", self._seccomp), _memfd("main.py", program.encode())]
            argv = _command(self.mode, c, uid, self.python, *fds)
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=env, cwd=work or "/", pass_fds=fds, start_new_session=True)
        finally:
            for fd in fds:
                os.close(fd)
        cap = c.output_kb << 10
        overflow = asyncio.Event()
        readers = [asyncio.create_task(_read_capped(s, cap, overflow)) for s in (proc.stdout, proc.stderr)]
        feeder = asyncio.create_task(_feed(proc.stdin, stdin))
        exited = asyncio.create_task(proc.wait())
        over = asyncio.create_task(overflow.wait())
        done, _ = await asyncio.wait({exited, over}, timeout=c.wall_s, return_when=asyncio.FIRST_COMPLETED)
        timed_out, overflowed = not done, over in done and not exited.done()
        if timed_out or overflowed:
            _kill_first_process(proc.pid)
            try:  # bwrap reaps it and exits; only if it does not is the whole group killed
                await asyncio.wait_for(asyncio.shield(exited), timeout=2.0)
            except asyncio.TimeoutError:
                log.warning("sandbox pid %d still alive 2 s after its first process was killed", proc.pid)
                _killpg(proc.pid)
        await exited
        over.cancel()
        feeder.cancel()
        (out, out_over), (err, err_over) = await _gather_bounded(readers, grace_s=1.0)
        wall_s = time.monotonic() - start
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        return _classify(proc.returncode, out, err, wall_s, timed_out, overflowed or out_over or err_over, c,
                         wrapped=self.mode != "none")


async def _read_capped(stream: asyncio.StreamReader, cap: int, overflow: asyncio.Event) -> tuple[bytes, bool]:
    """Keep the first `cap` bytes; past them, flag the overflow and read on, discarding, until EOF.

    It must read to EOF: asyncio's Process.wait() returns only once every pipe is closed, and a
    reader that stopped would leave a full pipe paused, and the wait hanging, after the kill.
    """
    data = bytearray()
    over = False
    while chunk := await stream.read(65536):
        if not over:
            data += chunk
            if len(data) > cap:
                over = True
                del data[cap:]
                overflow.set()
    return bytes(data), over


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            stdin.write(data)
            await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited (or was killed) without reading its input


async def _gather_bounded(readers: list[asyncio.Task], grace_s: float) -> list[tuple[bytes, bool]]:
    await asyncio.wait(readers, timeout=grace_s)
    out = []
    for task in readers:
        if task.done():
            out.append(task.result())
        else:
            task.cancel()
            out.append((b"", True))
    return out


def _kill_first_process(pid: int) -> None:
    """Kill the pid namespace's first process (the child of bwrap, which is `pid`).

    bwrap stays alive to reap it, and the kernel kills and reaps everything else in the namespace
    before that wait returns. Killing bwrap first would hand the namespace's first process to the
    machine's init as a zombie (in containers whose init never reaps: forever), each one counting
    against the slot uid's RLIMIT_NPROC.
    """
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    if not children:
        _killpg(pid)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _classify(code: int | None, out: bytes, err: bytes, wall_s: float, timed_out: bool, overflowed: bool,
              c: SandboxConfig, wrapped: bool) -> SandboxResult:
    sig = _signal_name(-code) if code is not None and code < 0 else None
    if wrapped and code is not None and 128 < code < 128 + signal.NSIG:
        # bwrap reports a program killed by signal n as exit 128 + n (as a shell does); a program that
        # exits 129..192 itself reads the same and fails either way.
        sig = _signal_name(code - 128)
    last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
    if timed_out:
        status, reason = "timeout", f"wall timeout after {c.wall_s:g} s: killed"
    elif overflowed:
        status, reason = "output_limit", f"printed more than {c.output_kb} KiB: killed"
    elif sig == "SIGXCPU" or (sig == "SIGKILL" and wall_s >= c.cpu_s):
        status, reason = "signal", f"CPU limit of {c.cpu_s} s reached ({sig})"
    elif sig == "SIGXFSZ":
        status, reason = "signal", f"file size limit of {c.fsize_mb} MiB reached"
    elif sig is not None:
        status, reason = "signal", f"killed by {sig}"
    elif code == 0:
        status, reason = "ok", "exit 0"
    elif "MemoryError" in last[0]:
        status, reason = "failed", f"memory limit of {c.mem_mb} MiB reached (MemoryError)"
    else:
        status, reason = "failed", f"exit {code}: {last[0][:200]}"
    return SandboxResult(status, code, sig, out, err, wall_s, reason)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"

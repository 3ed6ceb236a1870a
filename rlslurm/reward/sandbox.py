"""The code scorer's sandbox: model-written programs are hostile, so each runs bounded and alone.

    sandbox = Sandbox(SandboxConfig(), slots=8)
    result = await sandbox.execute("print(1 + 1)")       # SandboxResult(status="ok", stdout=b"2\\n", ...)

One process per execution, started through util-linux tools only (no preexec_fn: the service is
threaded and asyncio, where forking Python code is unsafe), so the chain is plain execs:

    setpriv --pdeathsig KILL         dies with the service (no orphans when it is SIGKILLed)
    unshare --net --mount --pid      no network (a fresh net namespace: even 127.0.0.1 is down), and
      sh -c 'mount tmpfs ...'        a private tmpfs as /tmp (its working dir), others over /var/tmp /dev/shm
        prlimit --cpu --as --nproc --fsize --nofile --core=0
          setpriv --reuid=U ...      an unprivileged uid of its own per slot (mode root)
            python3 -I -S main.py

Why a uid per slot: RLIMIT_NPROC does not bind for root and counts *per uid*, so only a uid of its
own makes a fork bomb hit its limit without starving other slots; it also makes os.kill on the
service (root) fail with EPERM (inside the pid namespace getppid() is 0 anyway) and forbids writes to anything not world-writable. The pid namespace
makes the program its init: when it ends, every process it left behind dies with it, including those
that escaped its process group with setsid().

mode userns (not root, e.g. a SLURM job as a user): an unprivileged user + pid + net + mount
namespace instead; no uid of its own, so no process-count limit, but the pid namespace dies with its
first process, which takes every descendant along, and the service is invisible from inside.
When neither works here, `require_isolation` decides: refuse (default) or run with rlimits only.

Every execution has a wall timeout after which its process group (and so its namespace) is killed, and stdout and
stderr are read up to `output_kb` each: one byte more and it is killed (status output_limit).
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

# Mount points every uid may write to: each gets a private, small tmpfs so nothing written there
# outlives the execution or is seen by another one.
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")


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
    candidates = {"auto": ["root", "userns"] if os.geteuid() == 0 else ["userns"]}.get(requested, [requested])
    for mode in candidates:
        if mode == "root" and os.geteuid() != 0:
            continue
        probe = _namespace_argv(mode) + ["sh", "-c", "mount -t tmpfs -o size=1m tmpfs /tmp"]
        try:
            done = subprocess.run(probe, capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("sandbox mode %s unavailable: %s", mode, e)
            continue
        if done.returncode == 0:
            return mode
        log.warning("sandbox mode %s unavailable: %s", mode, done.stderr.decode(errors="replace").strip())
    return "none"


def _namespace_argv(mode: str) -> list[str]:
    # A pid namespace whose first process is the program: when it exits or is killed, the kernel
    # kills every process it left behind (even those that setsid()'d out of its process group), and
    # reaps them, so no zombie keeps counting against the slot uid's RLIMIT_NPROC.
    pid_ns = ["--pid", "--fork", "--kill-child", "--mount-proc"]
    if mode == "root":
        return ["unshare", "--net", "--mount", *pid_ns, "--"]
    if mode == "userns":
        return ["unshare", "--user", "--map-root-user", "--net", "--mount", *pid_ns, "--"]
    return []


class Sandbox:
    """Runs Python programs under the limits of `cfg`, at most `slots` at once (one uid per slot)."""

    def __init__(self, cfg: SandboxConfig, slots: int, root: str | Path | None = None):
        self.cfg = cfg
        self.mode = detect_mode(cfg.mode)
        if self.mode == "none" and cfg.require_isolation:
            raise RewardServiceError(
                f"reward.sandbox: no namespace isolation works here (mode {cfg.mode!r}; `unshare --net` failed "
                "as root and as a user namespace); set reward.sandbox.require_isolation = false to run "
                "model-written code with rlimits only")
        python = shutil.which(cfg.python, path=SAFE_PATH)
        if python is None:
            raise RewardServiceError(f"reward.sandbox.python = {cfg.python!r} is not on {SAFE_PATH}")
        self.python = python
        self.root = Path(tempfile.mkdtemp(prefix="rlslurm-sandbox-", dir=root))
        self.root.chmod(0o711)  # slot uids may pass through to their own dir, not list the others
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

    def _argv(self, uid: int, workdir: Path) -> list[str]:
        c = self.cfg
        owner = f",uid={uid},gid={uid}" if self.mode == "root" else ""
        # Its working dir is a fresh tmpfs laid over /tmp itself; the program is copied in through the
        # cwd (the staging dir, which that mount then hides) and Python sees it as /tmp/main.py.
        steps = [f"mount -t tmpfs -o size={c.disk_mb}m,mode=0700{owner} tmpfs /tmp", "cp main.py /tmp/main.py",
                 "cd /tmp"]
        steps += [f"mount -t tmpfs -o size=4m,mode=1777 tmpfs {d}" for d in _WORLD_WRITABLE[1:] if os.path.isdir(d)]
        if self.mode == "none":
            steps = ['cd "$SANDBOX_WORK"', "cp ../main.py main.py"]
        setup = " && ".join(steps + ['exec "$@"'])
        limits = [f"--cpu={c.cpu_s}", f"--as={c.mem_mb << 20}", f"--fsize={c.fsize_mb << 20}",
                  f"--nofile={c.nofile}", "--core=0"]
        if self.mode == "root":
            limits.append(f"--nproc={c.nproc}")
        drop = (["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
                if self.mode == "root" else [])
        # SIGKILL when the service dies: a SIGKILLed service must not leave "sleep forever" running.
        orphan = ["setpriv", "--pdeathsig", "KILL", "--"]
        return [*orphan, *_namespace_argv(self.mode), "sh", "-c", setup, "sh", "prlimit", *limits, "--", *drop,
                self.python, "-I", "-S", "main.py"]

    async def _run(self, program: str, stdin: bytes, uid: int) -> SandboxResult:
        c = self.cfg
        home = Path(tempfile.mkdtemp(dir=self.root))
        home.chmod(0o711)
        (home / "main.py").write_text(program)
        (home / "main.py").chmod(0o644)
        work = home / "work"
        work.mkdir()
        env = {"PATH": SAFE_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "SANDBOX_WORK": str(work)}
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self._argv(uid, work), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=home, start_new_session=True)
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
            try:  # unshare reaps it and exits; only if it does not is the whole group killed
                await asyncio.wait_for(asyncio.shield(exited), timeout=2.0)
            except asyncio.TimeoutError:
                log.warning("sandbox pid %d still alive 2 s after its first process was killed", proc.pid)
                _killpg(proc.pid)
        await exited
        over.cancel()
        feeder.cancel()
        (out, out_over), (err, err_over) = await _gather_bounded(readers, grace_s=1.0)
        wall_s = time.monotonic() - start
        shutil.rmtree(home, ignore_errors=True)
        code = proc.returncode
        return _classify(code, out, err, wall_s, timed_out, overflowed or out_over or err_over, c)


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
    """Kill the pid namespace's first process (the child of unshare, which is `pid`).

    unshare stays alive to reap it, and the kernel kills and reaps everything else in the namespace
    before that wait returns. Killing unshare first would hand the namespace's first process to the
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
              c: SandboxConfig) -> SandboxResult:
    sig = signal.Signals(-code).name if code is not None and code < 0 else None
    last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
    if "unshare: sigprocmask unblock failed" in last[0]:
        # unshare --fork passes its child's death signal on by raising it on itself, which it cannot
        # do for SIGKILL: this line, exit 1, is how a SIGKILLed program (RLIMIT_CPU's hard limit) reads.
        sig, last = "SIGKILL", [""]
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

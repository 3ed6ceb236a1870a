"""Hostile programs through the real sandbox, in each isolation mode: every escape class of issue 15
and the earlier ones, each with the verdict (how it is contained) that the test asserts.

Every program runs for real (bubblewrap, namespaces, seccomp, rlimits; no mocks), all of a mode at
once on the sandbox's slots; the verdicts are regexes over "status / reason / stdout", and the host
side is checked too: nothing written, no connection accepted, no process left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import re
import secrets
import socket
import stat
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

import rlslurm
from rlslurm.reward.config import SandboxConfig
from rlslurm.reward.sandbox import Sandbox, detect_mode

# wall_s leaves the slowest contained program (the scan of its whole view, ~1.4 s here) room on a loaded
# 2-core machine; the programs that run into it cost wall_s each, two at a time.
CFG = SandboxConfig(cpu_s=1, wall_s=5.0, mem_mb=256, nproc=16, output_kb=16, disk_mb=8, fsize_mb=4)
MODES = ["root", "userns"]


@dataclass(frozen=True)
class Hostile:
    """One program and how it must end: every regex in `verdict` matches "status\\nreason\\nstdout"."""

    program: str
    verdict: tuple[str, ...]
    host_clean: tuple[str, ...] = field(default=())
    """Host paths (globs) that must not exist afterwards: what the program tried to leave behind."""


def _syscall_numbers(names: list[str]) -> dict[str, int]:
    import pyseccomp

    return {name: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) for name in names}


# name -> (arguments, errno the filter answers); arguments are invalid on purpose, so that a filter
# that failed open gets an error of the kernel's (EINVAL, EFAULT) instead of doing anything.
DENIED_CALLS = {
    "ptrace": ("0, 0, 0, 0", "EPERM"),                      # PTRACE_TRACEME: allowed without the filter
    "unshare": ("0x10000000", "EPERM"),                     # CLONE_NEWUSER: allowed unprivileged without it
    "setns": ("-1, 0", "EPERM"),
    "mount": ("b'none', b'/tmp', b'tmpfs', 0, 0", "EPERM"),
    "umount2": ("b'/tmp', 0", "EPERM"),
    "pivot_root": ("b'/tmp', b'/tmp'", "EPERM"),
    "chroot": ("b'/tmp'", "EPERM"),
    "keyctl": ("0, -3, 1", "EPERM"),                        # KEYCTL_GET_KEYRING_ID of the session keyring
    "add_key": ("b'user', b'k', b'v', 1, -3", "EPERM"),
    "request_key": ("b'user', b'k', 0, 0", "EPERM"),
    "bpf": ("99, 0, 0", "EPERM"),
    "perf_event_open": ("0, 0, -1, -1, 0", "EPERM"),
    "userfaultfd": ("1", "EPERM"),                          # UFFD_USER_MODE_ONLY
    "io_uring_setup": ("1, 0", "EPERM"),
    "kexec_load": ("0, 0, 0, 0", "EPERM"),
    "init_module": ("0, 0, b''", "EPERM"),
    "finit_module": ("-1, b'', 0", "EPERM"),
    "delete_module": ("b'nonexistent_module', 0", "EPERM"),
    "reboot": ("0, 0, 0, 0", "EPERM"),                      # wrong magic: EINVAL without the filter
    "swapon": ("b'/nonexistent', 0", "EPERM"),
    "swapoff": ("b'/nonexistent'", "EPERM"),
    "personality": ("0x0040000", "EPERM"),                  # ADDR_NO_RANDOMIZE: allowed without it
    "process_vm_readv": ("1, 0, 0, 0, 0, 0", "EPERM"),
    "fsopen": ("b'tmpfs', 0", "EPERM"),
    "shmget": ("0, 4096, 0o1600", "EPERM"),                 # IPC_PRIVATE, IPC_CREAT | 0600
    "clone": ("0x10000000 | 17, 0, 0, 0, 0", "EPERM"),      # CLONE_NEWUSER | SIGCHLD
    "clone3": ("0, 0", "ENOSYS"),                           # glibc then falls back to clone
}


@dataclass
class HostContext:
    """What the host holds for the programs to reach for, and the evidence afterwards."""

    token: str
    outside_dir: Path
    run_dir: Path
    tcp: socket.socket
    unix: dict[str, socket.socket]
    setuid_binary: str | None


def hostile_programs(ctx: HostContext, sandbox: Sandbox) -> dict[str, Hostile]:
    t = ctx.token
    numbers = _syscall_numbers(list(DENIED_CALLS))
    host_writable = sorted({"/run/lock", "/var/lock", "/var/tmp", "/tmp", "/dev/shm", "/dev/mqueue",
                            str(ctx.outside_dir)} | _world_writable_dirs())
    private = [str(Path(rlslurm.__file__)), str(Path(rlslurm.__file__).parents[1] / "pyproject.toml"),
               str(ctx.run_dir / "events.jsonl"), str(ctx.run_dir), str(sandbox.root), "/root", "/home",
               "/etc/passwd", "/etc/shadow", "/run", "/var", "/sys", "/dev/mem", "/dev/kmsg", "/work"]
    progs = {
        # ---- issue 15: the sandbox gaps -------------------------------------------------------
        "write_run_lock": Hostile(f"""
            for d in ("/run/lock", "/var/lock"):
                try:
                    open(f"{{d}}/escape-{t}", "w").write("x")
                    print(d, "written")
                except OSError as e:
                    print(d, type(e).__name__)
            """, (r"/run/lock FileNotFoundError", r"/var/lock FileNotFoundError"),
            (f"/run/lock/escape-{t}", f"/var/lock/escape-{t}")),
        "write_host_world_writable": Hostile(f"""
            import os
            for d in {host_writable!r}:
                try:
                    open(os.path.join(d, "escape-{t}"), "w").write("x")
                    print(d, "written")
                except OSError as e:
                    print(d, type(e).__name__)
            """, (r"\A(?!.*/(run|var)/lock written)",),
            tuple(f"{d}/escape-{t}" for d in host_writable)),
        "scan_writable_dirs": Hostile("""
            import os
            writable = []
            for root, dirs, files in os.walk("/"):
                if root == "/proc":
                    dirs[:] = []  # its own processes' files, not a filesystem
                    continue
                try:
                    fd = os.open(os.path.join(root, ".probe"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                except OSError:
                    continue
                os.close(fd)
                os.unlink(os.path.join(root, ".probe"))
                writable.append(root)
            print("writable:", writable)
            """, (r"writable: \['/tmp'\]",)),
        "many_small_files": Hostile(f"""
            import os
            total, errors = 0, set()
            for n, d in enumerate(("/tmp", "/dev/shm", "/run/lock", "/var/lock", "/var/tmp")):
                for i in range(4 * {CFG.disk_mb} * 16):  # up to 4 x disk_mb per place, 64 KiB at a time
                    try:
                        with open(f"{{d}}/small-{t}-{{n}}-{{i}}", "wb") as f:
                            f.write(b"x" * 65536)
                    except OSError as e:
                        errors.add(e.strerror)
                        break
                    total += 65536
            print("total bytes", total, "errors", sorted(errors))
            """, (r"No space left on device",), (f"/run/lock/small-{t}-*", f"/var/tmp/small-{t}-*",
                                                 f"/tmp/small-{t}-*", f"/dev/shm/small-{t}-*")),
        "host_unix_sockets": Hostile(f"""
            import socket
            for path in {sorted(ctx.unix)!r} + ["/run/munge/munge.socket.2", "/run/dbus/system_bus_socket",
                                               "/var/run/docker.sock", "/run/containerd/containerd.sock"]:
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(1)
                try:
                    s.connect(path)
                    print(repr(path), "connected")
                except OSError as e:
                    print(repr(path), type(e).__name__)
            """, (r"\A(?!.*connected)", r"'/run/rlslurm-[0-9a-f]+\.sock' FileNotFoundError",
                  r"'/tmp/rlslurm-[0-9a-f]+\.sock' FileNotFoundError",
                  r"'\\x00rlslurm-[0-9a-f]+' ConnectionRefusedError")),
        "read_private_files": Hostile(f"""
            import os
            for path in {private!r}:
                try:
                    os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(1)
                    print(path, "READ")
                except OSError as e:
                    print(path, type(e).__name__)
            """, (r"\A(?!.*READ)", *(rf"{re.escape(p)} FileNotFoundError" for p in private))),
        "setuid_binary": Hostile(f"""
            import os, subprocess
            # The dynamic loader prints the aux vector only for a process that gained no privilege: a setuid
            # exec that took effect sets AT_SECURE = 1 and the loader drops LD_SHOW_AUXV.
            done = subprocess.run([{ctx.setuid_binary!r}, "--version"], env={{"LD_SHOW_AUXV": "1"}},
                                  capture_output=True, text=True)
            print(done.stdout)
            print("my euid", os.geteuid())
            """, (r"AT_SECURE:\s+0\b", r"AT_EUID:\s+6\d{4}\b")),
        "capabilities": Hostile("""
            for line in open("/proc/self/status"):
                if line.startswith(("Cap", "NoNewPrivs", "Seccomp:", "Uid")):
                    print(line.strip())
            """, (*(rf"Cap{s}:\s+0000000000000000" for s in ("Inh", "Prm", "Eff", "Bnd", "Amb")),
                  r"NoNewPrivs:\s+1", r"Seccomp:\s+2", r"Uid:\s+6\d{4}\s")),
        "denied_syscalls": Hostile(f"""
            import ctypes, errno, os
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
            for name, (number, args) in {({n: (numbers[n], a) for n, (a, _) in DENIED_CALLS.items()})!r}.items():
                ctypes.set_errno(0)
                r = libc.syscall(number, *(ctypes.c_long(a) if isinstance(a, int) else a
                                           for a in eval("(" + args + ",)")))
                if r == 0 and name == "clone":
                    os._exit(0)  # a child of a clone that was let through
                print(name, r, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
            for family in (40, 38, 17):  # AF_VSOCK, AF_ALG, AF_PACKET
                try:
                    __import__("socket").socket(family, 1 if family != 17 else 3)
                    print("family", family, "opened")
                except OSError as e:
                    print("family", family, errno.errorcode[e.errno])
            """, (*(rf"\b{n} -1 {e}\b" for n, (_, e) in DENIED_CALLS.items()),
                  r"family 40 EAFNOSUPPORT", r"family 38 EAFNOSUPPORT", r"family 17 EAFNOSUPPORT")),
        "environment_and_mounts": Hostile("""
            import os
            print("env", sorted(os.environ))
            print("cwd", os.getcwd(), sorted(os.listdir(".")))
            print(open("/proc/self/mountinfo").read())
            """, (r"env \['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONDONTWRITEBYTECODE', 'TMPDIR'\]",
                  r"cwd /tmp \['main.py'\]", r"\A(?!.*rlslurm-sandbox-)(?!.*/work/)")),
        "normal_program": Hostile("""
            import multiprocessing, os, subprocess, sys, tempfile, threading
            results = []
            t = threading.Thread(target=results.append, args=("thread",)); t.start(); t.join()
            pid = os.fork()
            if pid == 0:
                os._exit(7)
            results.append(f"fork {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}")
            echoed = subprocess.run(["/usr/bin/echo", "subprocess"], capture_output=True, text=True)
            results.append(echoed.stdout.strip())
            with multiprocessing.Pool(2) as pool:
                results.append(f"pool {sum(pool.map(abs, [-1, -2, -3]))}")
            with tempfile.NamedTemporaryFile() as f:
                f.write(b"x" * 100000); f.flush(); results.append(f"tempfile {os.path.getsize(f.name)}")
            open("out.txt", "w").write("cwd"); results.append(open("out.txt").read())
            results.append(f"stdin {sys.stdin.read()!r}")
            print(results)
            """, (r"ok\nexit 0", r"\['thread', 'fork 7', 'subprocess', 'pool 6', 'tempfile 100000', 'cwd', "
                  r"\"stdin ''\"\]")),
        # ---- the earlier classes --------------------------------------------------------------
        "process_limit": Hostile("""
            import os, time
            n = 0
            while True:
                try:
                    pid = os.fork()
                except OSError as e:
                    print(f"fork refused after {n}: {e.strerror}")
                    break
                if pid == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
            """, (r"fork refused after ([0-9]|1[0-5]): Resource temporarily unavailable",)),  # < nproc = 16
        "fork_bomb": Hostile("""
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
            """, (r"wall timeout|CPU limit",)),
        "memory_bomb": Hostile("""
            chunks = []
            while True:
                chunks.append(bytearray(50 * 2**20))
            """, (r"failed\nmemory limit of 256 MiB",)),
        "cpu_loop": Hostile("while True:\n    pass\n", (r"signal\nCPU limit of 1 s|timeout\nwall timeout",)),
        "sleep_forever": Hostile("import time\ntime.sleep(10**6)\n", (r"timeout\nwall timeout after 5 s",)),
        "network": Hostile(f"""
            import socket
            socket.create_connection(("127.0.0.1", {ctx.tcp.getsockname()[1]}), timeout=2)
            """, (r"Network is unreachable",)),
        "write_outside": Hostile(f"open({str(ctx.outside_dir / 'escaped.txt')!r}, 'w').write('escaped')\n",
                                 (r"FileNotFoundError",), (str(ctx.outside_dir / "escaped.txt"),)),
        "kill_service": Hostile(f"""
            import os, signal
            print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
            try:
                os.kill({os.getpid()}, signal.SIGKILL)
                print("killed the service")
            except OSError as e:
                print("service:", type(e).__name__)
            """, (r"pids \[1\]", r"service: ProcessLookupError")),
        "setsid_escape": Hostile(f"""
            import os, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv("/usr/bin/sleep", ["sleep", "{4000 + int(t[:4], 16) % 1000}.5"])
                os._exit(0)
            time.sleep(0.3)
            print("left a setsid() grandchild behind")
            """, (r"ok\nexit 0",)),
        "stdout_flood": Hostile("import sys\nline = 'x' * 2**20\nwhile True:\n    sys.stdout.write(line)\n",
                                (r"output_limit\nprinted more than 16 KiB",)),
    }
    if ctx.setuid_binary is None:
        del progs["setuid_binary"]
    return progs


@functools.cache
def _world_writable_dirs() -> frozenset[str]:
    """World-writable directories of the host's system tree (not /proc, /sys, nor this repository)."""
    found = set()
    for top in ("/run", "/var", "/tmp", "/dev", "/etc", "/opt", "/srv", "/home", "/usr"):
        for root, dirs, _ in os.walk(top):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
            try:
                st = os.stat(root)
            except OSError:
                continue
            if st.st_mode & stat.S_IWOTH and stat.S_ISDIR(st.st_mode):
                found.add(root)
                dirs[:] = []  # its own content is the program's to fill, not more host paths
    return frozenset(found)


def _setuid_root_binary() -> str | None:
    for path in ("/usr/bin/su", "/usr/bin/mount", "/usr/bin/passwd", "/usr/bin/newgrp", "/usr/bin/chfn"):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_mode & stat.S_ISUID and st.st_uid == 0:
            return path
    return None


@pytest.fixture(scope="module", params=MODES)
def contained(request, tmp_path_factory):
    """Every hostile program run once in one mode: (results by name, programs, host context)."""
    mode = request.param
    if mode == "root" and os.geteuid() != 0:
        pytest.skip("mode root needs the service to run as root")
    assert detect_mode(mode) == mode, f"sandbox mode {mode} does not work here (see the log)"
    token = secrets.token_hex(8)
    outside = tmp_path_factory.mktemp("outside")
    outside.chmod(0o777)  # writable by anyone on the host: only the sandbox may stop the write
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "events.jsonl").write_text('{"kind": "secret"}\n')
    run_dir.chmod(0o755)
    tcp = socket.create_server(("127.0.0.1", 0))
    tcp.settimeout(0.2)
    unix = {}
    for path in ([f"/run/rlslurm-{token}.sock"] if os.access("/run", os.W_OK) else []) + [f"/tmp/rlslurm-{token}.sock",
                                                                                        f"\0rlslurm-{token}"]:
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        if not path.startswith("\0"):
            os.chmod(path, 0o777)
        s.listen()
        s.settimeout(0.2)
        unix[path] = s
    ctx = HostContext(token, outside, run_dir, tcp, unix, _setuid_root_binary())
    sandbox = Sandbox(dataclasses.replace(CFG, mode=mode), slots=2)
    programs = hostile_programs(ctx, sandbox)

    async def run_all():
        return await asyncio.gather(*(sandbox.execute(textwrap.dedent(p.program)) for p in programs.values()))

    try:
        results = dict(zip(programs, asyncio.run(run_all())))
        yield results, programs, ctx
    finally:
        sandbox.close()
        # What an escape left on the host (the tests above report it) must not outlive this run.
        for pattern in (pat for prog in programs.values() for pat in prog.host_clean):
            for hit in Path("/").glob(pattern.lstrip("/")):
                hit.unlink(missing_ok=True)
        tcp.close()
        for path, s in unix.items():
            s.close()
            if not path.startswith("\0"):
                os.unlink(path)


@pytest.mark.parametrize("name", [
    "write_run_lock", "write_host_world_writable", "scan_writable_dirs", "many_small_files", "host_unix_sockets",
    "read_private_files", "setuid_binary", "capabilities", "denied_syscalls", "environment_and_mounts",
    "normal_program", "process_limit", "fork_bomb", "memory_bomb", "cpu_loop", "sleep_forever", "network",
    "write_outside", "kill_service", "setsid_escape", "stdout_flood"])
def test_hostile_program_is_contained(contained, name):
    results, programs, ctx = contained
    if name not in programs:
        pytest.skip("no setuid-root binary on this host to try")
    r, p = results[name], programs[name]
    text = f"{r.status}\n{r.reason}\n{r.stdout.decode(errors='replace')}"
    missed = [v for v in p.verdict if not re.search(v, text, re.S)]
    assert not missed, f"{name}: verdict {missed} not in:\n{text[:3000]}\nstderr: {r.stderr[-1500:]!r}"
    left = [hit for pattern in p.host_clean for hit in map(str, Path("/").glob(pattern.lstrip("/")))]
    assert not left, f"{name} left files on the host: {left}"


def test_many_small_files_stop_at_disk_mb(contained):
    results, _, _ = contained
    total = int(re.search(r"total bytes (\d+)", results["many_small_files"].stdout.decode()).group(1))
    assert 0 < total <= CFG.disk_mb << 20, total


def test_nothing_reached_or_left_on_the_host(contained):
    results, _, ctx = contained
    for listener in (ctx.tcp, *ctx.unix.values()):
        with pytest.raises(TimeoutError):
            listener.accept()
    sleeper = f"{4000 + int(ctx.token[:4], 16) % 1000}.5"
    assert [p.info for p in psutil.process_iter(["pid", "cmdline"]) if sleeper in (p.info["cmdline"] or [])] == []
    assert [p.info for p in psutil.process_iter(["pid", "uids", "name"])
            if p.info["uids"] and p.info["uids"].real >= CFG.uid_base] == []


def test_without_isolation_it_refuses_unless_told_to_run_with_rlimits_only(monkeypatch):
    """require_isolation: where no mode works (here: every probe answers why not), the sandbox refuses
    to start and names the reason; with require_isolation false it runs programs bounded by rlimits."""
    import rlslurm.reward.sandbox as sandbox_module
    from rlslurm.errors import RewardServiceError

    monkeypatch.setattr(sandbox_module, "_probe", lambda mode: f"{mode} switched off for this test")
    sandbox_module.detect_mode.cache_clear()
    try:
        with pytest.raises(RewardServiceError, match=r"no isolation works here .*root switched off for this test.*"
                                                     r"require_isolation = false"):
            Sandbox(dataclasses.replace(CFG, mode="root"), slots=1)
        sandbox = Sandbox(dataclasses.replace(CFG, mode="root", require_isolation=False), slots=1)
        try:
            assert sandbox.mode == "none"
            ok = asyncio.run(sandbox.execute("print(6 * 7)"))
            loop = asyncio.run(sandbox.execute("while True:\n    pass\n"))
            assert (ok.status, ok.stdout) == ("ok", b"42\n")
            assert (loop.status, loop.reason) == ("signal", "CPU limit of 1 s reached (SIGKILL)")
        finally:
            sandbox.close()
    finally:
        sandbox_module.detect_mode.cache_clear()

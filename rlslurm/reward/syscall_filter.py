"""The seccomp filter of the code scorer's sandbox: the system calls a model-written program never gets.

    bpf = sandbox_filter_bpf()      # bytes: a classic-BPF program, loaded by `bwrap --seccomp FD`

Built with libseccomp through `pyseccomp` (ctypes over Debian's libseccomp2, API-compatible with
libseccomp's own bindings) in the trusted service, once, and exported as BPF that bubblewrap installs
just before it execs the sandbox chain: no launcher runs inside the sandbox and no filter code is
hand-assembled. Why a kept library: libseccomp resolves syscall names per architecture, guards the
architecture (an x32 or i386 entry, e.g. `int 0x80`, kills the process instead of slipping past a
table of x86_64 numbers) and emits the BPF; writing that by hand is where filters go wrong.

A deny list over an allowing default, like Docker's and Flatpak's filters, not an allow list: the
sandbox runs arbitrary Python (threads, subprocesses, ctypes), and an allow list misses one call of
some library and turns a correct answer into a failed one. The filesystem view, the empty capability
set and no_new_privs carry the rest; these calls are the kernel surface that those do not close.
"""

from __future__ import annotations

import errno
import functools
import tempfile

# Denied with EPERM, with why; names unknown to this libseccomp (older kernels' tables) are skipped.
DENIED: dict[str, str] = {
    **dict.fromkeys(("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
                    "reading or steering another process"),
    **dict.fromkeys(("mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
                     "fsmount", "fspick", "mount_setattr"), "changing the filesystem view"),
    **dict.fromkeys(("unshare", "setns"), "new or other namespaces (no re-nesting)"),
    **dict.fromkeys(("keyctl", "add_key", "request_key"), "the kernel keyring (not namespaced)"),
    **dict.fromkeys(("bpf", "perf_event_open", "userfaultfd"), "kernel attack surface used by exploits"),
    **dict.fromkeys(("io_uring_setup", "io_uring_enter", "io_uring_register"),
                    "io_uring: a second syscall path that seccomp does not see"),
    **dict.fromkeys(("kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
                     "swapon", "swapoff", "acct", "quotactl", "syslog", "vhangup", "iopl", "ioperm",
                     "name_to_handle_at", "open_by_handle_at", "fanotify_init", "lookup_dcookie"),
                    "machine administration"),
    "shmget": "SysV shared memory, which RLIMIT_AS does not count while it is detached",
}

# clone() flags that make a namespace: clone(CLONE_NEWUSER | ...) is unshare by another name.
_CLONE_NS_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000)  # NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
# Socket families a program may open: local ones (unix, netlink for glibc's interface queries) and IP,
# which the empty network namespace makes moot. The rest are not namespaced, or are kernel surface
# (AF_VSOCK reaches the hypervisor from a VM, AF_ALG the kernel's crypto).
_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
_AF_MAX = 64


@functools.cache
def sandbox_filter_bpf() -> bytes:
    """The sandbox's seccomp program as BPF bytes (built once per process)."""
    import pyseccomp as sc  # loads libseccomp.so.2 when imported: only where the code scorer runs

    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError):
            continue  # a syscall this libseccomp does not know on this architecture
    # clone3 passes its flags in a struct seccomp cannot read: ENOSYS makes glibc fall back to clone(),
    # whose flags it can.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NS_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # personality() turns off address randomisation or makes reads imply exec; only PER_LINUX stays.
    f.add_rule(sc.ERRNO(errno.EPERM), "personality", sc.Arg(0, sc.NE, 0))
    for family in range(_AF_MAX):
        if family not in _SOCKET_FAMILIES:
            f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, family))
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.GE, _AF_MAX))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)  # writes through the file descriptor
        out.seek(0)
        return out.read()

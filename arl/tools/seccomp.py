"""The sandbox's seccomp policy: an allowlist of the system calls a CPython program of the
standard library needs, compiled to a classic-BPF program by libseccomp (`pyseccomp`)
in the calling process. The supervisor's child installs it right before it executes the
worker's interpreter (`arl.tools._sandbox_kernel.install_seccomp_and_exec`).

The policy (docs/tools.md gives the reason for every entry):

* `ALLOWED` system calls run; `fcntl`, `ioctl`, `clone` and `prlimit64` only with the
  arguments in `CONDITIONAL` (descriptor flags but no locks or leases, terminal queries,
  threads, reading limits);
* `REFUSED` ones fail with EPERM (what a program may reach for and must not have:
  processes, sockets, locks, device nodes, links, mounts, namespaces, ...); `clone3`
  fails with ENOSYS, on which glibc creates threads with `clone`;
* `execve`/`execveat` notify a listener: the child that installs the filter answers the
  one notification of its own `execve` into the worker's interpreter, and the listener
  is gone with that `execve`, so every later one fails with ENOSYS;
* everything else fails with ENOSYS (as on an older kernel, so glibc takes its fallbacks);
* a system call of another ABI (32-bit x86, x32) kills the process.

Architectures: x86_64 and aarch64 (libseccomp's tables give each name its number); on
another one, or without libseccomp, `filter_program()` returns None and
`sandbox_capabilities().seccomp` is False.
"""

from __future__ import annotations

import errno
import functools
import logging
import platform
import tempfile

_log = logging.getLogger("arl.tools.sandbox")

# Two numbers the supervisor needs even where libseccomp is missing (the minimal root's
# pivot_root; glibc wraps neither). `tests/tools/test_seccomp.py` checks them against
# libseccomp's tables.
SYSCALL_NUMBERS = {
    "x86_64": {"pivot_root": 155, "seccomp": 317},
    "aarch64": {"pivot_root": 41, "seccomp": 277},
}
_ARCH_ALIASES = {"x86_64": "x86_64", "amd64": "x86_64", "AMD64": "x86_64",
                 "aarch64": "aarch64", "arm64": "aarch64"}

ALLOWED = {  # name -> why a standard-library program needs it
    # reading and writing files and pipes
    "read": "file and pipe I/O", "write": "file and pipe I/O", "readv": "buffered I/O",
    "writev": "buffered I/O", "pread64": "os.pread, zipfile", "pwrite64": "os.pwrite",
    "preadv": "os.preadv", "pwritev": "os.pwritev", "preadv2": "os.preadv",
    "pwritev2": "os.pwritev", "lseek": "file positions, io's tell/seek",
    "close": "closing descriptors", "close_range": "os.closerange",
    "sendfile": "shutil.copyfile's fast path (file to file)",
    "copy_file_range": "os.copy_file_range (file to file)",
    "fsync": "os.fsync", "fdatasync": "os.fdatasync",
    "ftruncate": "file.truncate", "truncate": "os.truncate",
    "fallocate": "os.posix_fallocate (bounded by the working tmpfs)",
    "fadvise64": "os.posix_fadvise",
    # opening and inspecting paths
    "open": "opening files (x86_64)", "openat": "opening files",
    "stat": "os.stat (x86_64)", "lstat": "os.lstat (x86_64)", "fstat": "os.fstat, io",
    "newfstatat": "os.stat, the import system", "statx": "glibc's stat on newer builds",
    "statfs": "os.statvfs", "fstatfs": "os.fstatvfs",
    "access": "os.access (x86_64)", "faccessat": "os.access",
    "faccessat2": "os.access (glibc tries it first)",
    "readlink": "os.readlink, realpath (x86_64)", "readlinkat": "os.readlink, realpath",
    "getdents64": "os.listdir, os.scandir", "getcwd": "os.getcwd, the import system",
    "chdir": "changing directory inside the root", "fchdir": "changing directory by fd",
    "umask": "os.umask, tempfile",
    "getxattr": "os.getxattr", "lgetxattr": "os.getxattr", "fgetxattr": "os.getxattr",
    "listxattr": "shutil.copystat", "llistxattr": "shutil.copystat (symlinks)",
    "flistxattr": "os.listxattr by fd",
    # changing the working directory's files (the only writable file system)
    "mkdir": "os.mkdir (x86_64)", "mkdirat": "os.mkdir", "rmdir": "os.rmdir (x86_64)",
    "unlink": "os.remove (x86_64)", "unlinkat": "os.remove, shutil.rmtree",
    "rename": "os.rename (x86_64)", "renameat": "os.rename", "renameat2": "os.rename",
    "chmod": "os.chmod (x86_64)", "fchmod": "os.chmod by fd", "fchmodat": "os.chmod",
    "utimensat": "os.utime (read-only mounts refuse it outside /tmp)",
    # descriptors
    "dup": "os.dup", "dup2": "os.dup2 (x86_64)", "dup3": "os.dup2",
    "pipe": "os.pipe (x86_64)", "pipe2": "os.pipe",
    # memory
    "brk": "the C heap", "mmap": "the allocator, mmap, loading extension modules",
    "munmap": "the allocator", "mremap": "the allocator (realloc)",
    "mprotect": "the dynamic loader, thread stacks", "madvise": "the allocator",
    # threads, synchronisation, signals
    "futex": "locks, the GIL", "set_robust_list": "thread start-up",
    "set_tid_address": "thread start-up", "rseq": "thread start-up (glibc >= 2.35)",
    "sched_yield": "spin locks", "sched_getaffinity": "os.sched_getaffinity, cpu_count",
    "exit": "a thread ends", "exit_group": "the program ends",
    "rt_sigaction": "signal handlers", "rt_sigprocmask": "signal masks, threads",
    "rt_sigreturn": "returning from a handler", "sigaltstack": "faulthandler",
    "rt_sigpending": "signal.sigpending", "rt_sigtimedwait": "signal.sigtimedwait",
    "rt_sigsuspend": "signal.pause", "pause": "signal.pause (x86_64)",
    "kill": "os.kill / signal.raise_signal (own PID namespace only)",
    "tgkill": "raise(), os.abort", "tkill": "signals to own threads",
    "alarm": "signal.alarm (x86_64)", "setitimer": "signal.setitimer",
    "getitimer": "signal.getitimer", "wait4": "os.wait (no children: ECHILD)",
    "waitid": "os.waitid (no children: ECHILD)",
    # identity and limits (reading only)
    "getpid": "os.getpid", "gettid": "threading", "getppid": "os.getppid",
    "getuid": "os.getuid", "geteuid": "os.geteuid", "getgid": "os.getgid",
    "getegid": "os.getegid", "getresuid": "os.getresuid", "getresgid": "os.getresgid",
    "getgroups": "os.getgroups", "getpgrp": "os.getpgrp (x86_64)",
    "getpgid": "os.getpgid", "getsid": "os.getsid", "getrlimit": "resource.getrlimit",
    "getrusage": "resource.getrusage, time.process_time", "times": "os.times",
    "uname": "platform, os.uname", "sysinfo": "glibc's memory queries",
    "getcpu": "sched_getcpu", "getpriority": "os.getpriority",
    "arch_prctl": "x86_64 thread-local storage at start-up",
    # time, waiting, randomness
    "clock_gettime": "time.time, time.monotonic", "clock_getres": "time.get_clock_info",
    "gettimeofday": "time (x86_64)", "time": "time (x86_64)",
    "clock_nanosleep": "time.sleep", "nanosleep": "time.sleep",
    "select": "select.select (x86_64)", "pselect6": "select.select",
    "poll": "select.poll (x86_64)", "ppoll": "select.poll",
    "epoll_create": "select.epoll (x86_64)", "epoll_create1": "select.epoll, selectors",
    "epoll_ctl": "select.epoll", "epoll_wait": "select.epoll (x86_64)",
    "epoll_pwait": "select.epoll", "epoll_pwait2": "select.epoll",
    "getrandom": "os.urandom, random, hash randomisation",
}

# Allowed with these arguments only: name -> ((argument index, mask, value), ...): the
# call is allowed when (argument & mask) == value for one of the entries.
_ALL = 0xFFFFFFFF
_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACES = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                     | 0x20000000 | 0x40000000)  # NEWNS CGROUP UTS IPC USER PID NET
CONDITIONAL = {
    # descriptor flags and duplication (F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL,
    # F_DUPFD_CLOEXEC, F_GETPIPE_SZ); not F_SETLK/F_OFD_SETLK (locks), F_SETLEASE,
    # F_NOTIFY, F_SETPIPE_SZ (bigger pipe buffers), F_SETOWN/F_SETSIG, seals
    "fcntl": tuple((1, _ALL, command) for command in (0, 1, 2, 3, 4, 1030, 1032)),
    # isatty (TCGETS), os.get_terminal_size (TIOCGWINSZ), FIONREAD, os.set_blocking
    # (FIONBIO), os.set_inheritable (FIONCLEX, FIOCLEX)
    "ioctl": tuple((1, _ALL, command) for command in
                   (0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451)),
    # threads: CLONE_THREAD set and no namespace flag (fork's and posix_spawn's clones
    # have no CLONE_THREAD: EPERM, below)
    "clone": ((0, _CLONE_THREAD | _CLONE_NAMESPACES, _CLONE_THREAD),),
    # resource.getrlimit through glibc: prlimit64(0, resource, NULL, &old)
    "prlimit64": ((2, 0xFFFFFFFFFFFFFFFF, 0),),
}
# The same calls with other arguments: EPERM (the rest: ENOSYS).
CONDITIONAL_REFUSED = {
    "clone": ((0, _CLONE_THREAD, 0),),            # a new process: fork, posix_spawn
    # record locks (F_GETLK/SETLK/SETLKW, the F_OFD_ ones), leases, F_NOTIFY, F_SETPIPE_SZ:
    # locks and leases on the shared read-only inodes are a covert channel
    "fcntl": tuple((1, _ALL, command) for command in (5, 6, 7, 36, 37, 38, 1024, 1025,
                                                      1026, 1031)),
    "prlimit64": ((2, 0xFFFFFFFFFFFFFFFF, None),),  # setting a limit (None: nonzero)
}

REFUSED = (  # EPERM: what a program may reach for and must not have
    "fork", "vfork",                                   # processes
    "socket", "socketpair",                            # network; socket buffers are
                                                       # kernel memory outside RLIMIT_AS
    "flock",                                           # locks on shared inodes: a covert
                                                       # channel between sandboxes
    "mknod", "mknodat",                                # FIFOs and device nodes
    "link", "linkat", "symlink", "symlinkat",          # links (the hooks refuse them too)
    "chown", "fchown", "lchown", "fchownat",           # owners
    "setxattr", "lsetxattr", "fsetxattr",              # extended attributes: kernel
    "removexattr", "lremovexattr", "fremovexattr",     # memory of the tmpfs, and shutil
                                                       # copes with EPERM
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    "setfsuid", "setfsgid", "setsid", "setpgid",
    "setrlimit", "setpriority", "sched_setaffinity", "sched_setscheduler",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open",
    "pidfd_send_signal", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "shmdt", "msgget",
    "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl", "semtimedop", "mq_open",
    "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
    "splice", "vmsplice", "tee",                       # pages pinned in pipe buffers
    "prctl", "seccomp", "personality", "mlock", "mlock2", "mlockall",
    "name_to_handle_at", "open_by_handle_at",
)
# ENOSYS, on which glibc falls back: clone3's flags sit behind a pointer the filter cannot
# read, glibc then creates threads with clone.
FALLBACK = ("clone3",)
EXEC = ("execve", "execveat")


def machine_arch(machine: str | None = None) -> str | None:
    """'x86_64' or 'aarch64' for this (or the given) machine, None for any other."""
    return _ARCH_ALIASES.get(platform.machine() if machine is None else machine)


def syscall_number(name: str, machine: str | None = None) -> int | None:
    """The number of `pivot_root` or `seccomp` on this machine's architecture, or None."""
    return SYSCALL_NUMBERS.get(machine_arch(machine), {}).get(name)


def _libseccomp():
    try:
        import pyseccomp  # pylint: disable=import-outside-toplevel
        return pyseccomp
    except Exception as exc:  # pylint: disable=broad-except (no libseccomp.so: RuntimeError)
        _log.warning("arl.tools.sandbox: no seccomp filter: libseccomp is not available "
                     "(%s: %s); install the system's libseccomp2 and `pip install "
                     "pyseccomp`", type(exc).__name__, exc)
        return None


@functools.lru_cache(maxsize=None)
def filter_program(machine: str | None = None) -> bytes | None:
    """The policy (module docstring) as the bytes of a `struct sock_filter[]` for this (or
    the given) machine's architecture; None without libseccomp or on another arch."""
    arch = machine_arch(machine)
    if arch is None:
        _log.warning("arl.tools.sandbox: no seccomp filter on this architecture (%s): the "
                     "policy covers x86_64 and aarch64 only, so the sandbox has no kernel "
                     "boundary here", machine or platform.machine())
        return None
    seccomp = _libseccomp()
    if seccomp is None:
        return None
    try:
        return _compile(seccomp, getattr(seccomp.Arch, arch.upper()))
    except OSError as exc:  # e.g. a libseccomp or kernel without user notification
        _log.warning("arl.tools.sandbox: no seccomp filter: libseccomp could not compile "
                     "the policy for %s (%s)", arch, exc)
        return None


def _compile(seccomp, table: int) -> bytes:
    """The policy compiled by libseccomp (the `pyseccomp` module) for one architecture."""
    policy = seccomp.SyscallFilter(seccomp.ERRNO(errno.ENOSYS))
    policy.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    try:
        policy.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)  # a binary tree (libseccomp >= 2.5)
    except OSError:
        pass
    if seccomp.system_arch() != table:
        policy.add_arch(table)
        policy.remove_arch(seccomp.Arch.NATIVE)

    def add(action, name, *conditions):
        if seccomp.resolve_syscall(table, name) >= 0:  # e.g. no `open` on aarch64
            policy.add_rule(action, name, *conditions)

    for name in ALLOWED:
        add(seccomp.ALLOW, name)
    for name, entries in CONDITIONAL.items():
        for index, mask, value in entries:
            add(seccomp.ALLOW, name, seccomp.Arg(index, seccomp.MASKED_EQ, mask, value))
    for name, entries in CONDITIONAL_REFUSED.items():
        for index, mask, value in entries:
            condition = (seccomp.Arg(index, seccomp.NE, 0) if value is None
                         else seccomp.Arg(index, seccomp.MASKED_EQ, mask, value))
            add(seccomp.ERRNO(errno.EPERM), name, condition)
    for name in REFUSED:
        add(seccomp.ERRNO(errno.EPERM), name)
    # FALLBACK: the default action already (libseccomp refuses a rule that repeats it)
    for name in EXEC:
        add(seccomp.NOTIFY, name)
    with tempfile.TemporaryFile() as exported:
        policy.export_bpf(exported)
        exported.seek(0)
        return exported.read()

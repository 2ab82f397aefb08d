"""The sandbox's seccomp filter: a classic-BPF program, assembled here, that the worker
installs (`prctl(PR_SET_NO_NEW_PRIVS)` then `prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`,
see `arl.tools._sandbox_child`) right before the untrusted program runs.

Why our own few lines instead of libseccomp: the filter is a fixed list, the worker must
install it from a fresh `python -I -S` (standard library only, so `ctypes` + `prctl`),
and CI machines have no libseccomp. The kernel ABI (`struct seccomp_data`, the BPF
opcodes, the return actions) is stable: linux/seccomp.h, linux/filter.h.

The program, for x86_64 (the only table here; elsewhere `seccomp_filter()` returns None
and `sandbox_capabilities().seccomp` is False):

* another architecture (a 32-bit `int 0x80` call) or the x32 ABI: the process is killed;
* process creation: `execve`/`execveat`, `fork`/`vfork`, `clone` without CLONE_THREAD or
  with a namespace flag: EPERM; `clone3` (its flags sit behind a pointer the filter
  cannot read): ENOSYS, on which glibc falls back to `clone` for threads;
* `socket` of any family but AF_UNIX: EAFNOSUPPORT;
* the `DENIED` system calls (debugging other processes, device nodes and FIFOs, mounts,
  namespaces, keyrings, BPF, perf, userfaultfd, io_uring, pidfds, modules, clocks,
  memfds, SysV/POSIX IPC, hard links, ...): EPERM;
* any system call numbered above `LAST_REVIEWED` (newer than this list): ENOSYS;
* everything else is allowed.
"""

from __future__ import annotations

import platform
import struct

# linux/audit.h, linux/seccomp.h, linux/filter.h, linux/sched.h, errno.h
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
AF_UNIX = 1
CLONE_THREAD = 0x00010000
CLONE_NAMESPACES = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                    | 0x20000000 | 0x40000000)  # NEWNS CGROUP UTS IPC USER PID NET

_LD_W_ABS = 0x20   # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15      # BPF_JMP | BPF_JEQ | BPF_K
_JGT_K = 0x25      # BPF_JMP | BPF_JGT | BPF_K
_JSET_K = 0x45     # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06      # BPF_RET | BPF_K
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0 = 0, 4, 16  # struct seccomp_data (low word of arg 0)

# x86_64 numbers (asm/unistd_64.h); `tests/tools/test_seccomp.py` checks them against the
# header where it is installed.
X86_64 = {
    "execve": 59, "execveat": 322, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435,
    "socket": 41,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438,
    "process_madvise": 440, "process_mrelease": 448, "move_pages": 279,
    "migrate_pages": 256,
    "mknod": 133, "mknodat": 259, "link": 86, "linkat": 265,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "unshare": 272, "setns": 308,
    "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "lookup_dcookie": 212, "fanotify_init": 300, "quotactl": 179, "quotactl_fd": 443,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173,
    "modify_ldt": 154, "syslog": 103, "vhangup": 153, "uselib": 134, "personality": 135,
    "memfd_create": 319, "memfd_secret": 447,
    "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "msgget": 68, "msgsnd": 69,
    "msgrcv": 70, "msgctl": 71, "semget": 64, "semop": 65, "semctl": 66,
    "semtimedop": 220, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242,
    "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
}
LAST_REVIEWED = 450  # x86_64 system calls above this number get ENOSYS
DENIED = tuple(name for name in X86_64 if name not in (
    "execve", "execveat", "fork", "vfork", "clone", "clone3", "socket"))
REFUSED_PROCESS_CREATION = ("execve", "execveat", "fork", "vfork")


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _errno(number: int) -> int:
    return RET_ERRNO | number


def assemble(table: dict[str, int], arch: int, last_reviewed: int) -> bytes:
    """The filter (module docstring) for one architecture's system call `table`, as the
    bytes of a `struct sock_filter[]`."""
    program = [
        _instruction(_LD_W_ABS, _OFFSET_ARCH),
        _instruction(_JEQ_K, arch, jt=1),
        _instruction(_RET_K, RET_KILL_PROCESS),
        _instruction(_LD_W_ABS, _OFFSET_NR),
        _instruction(_JGT_K, X32_SYSCALL_BIT - 1, jf=1),
        _instruction(_RET_K, RET_KILL_PROCESS),
        _instruction(_JGT_K, last_reviewed, jf=1),
        _instruction(_RET_K, _errno(ENOSYS)),
    ]

    def refuse(name, action):
        program.extend([_instruction(_JEQ_K, table[name], jf=1), _instruction(_RET_K, action)])

    for name in REFUSED_PROCESS_CREATION + DENIED:
        refuse(name, _errno(EPERM))
    refuse("clone3", _errno(ENOSYS))
    # clone: allowed only for a thread (CLONE_THREAD set, no namespace flag).
    program.extend([
        _instruction(_JEQ_K, table["clone"], jf=5),
        _instruction(_LD_W_ABS, _OFFSET_ARG0),
        _instruction(_JSET_K, CLONE_THREAD, jf=2),
        _instruction(_JSET_K, CLONE_NAMESPACES, jt=1),
        _instruction(_RET_K, RET_ALLOW),
        _instruction(_RET_K, _errno(EPERM)),
    ])
    # socket: AF_UNIX only; the last instruction allows everything else.
    program.extend([
        _instruction(_JEQ_K, table["socket"], jf=3),
        _instruction(_LD_W_ABS, _OFFSET_ARG0),
        _instruction(_JEQ_K, AF_UNIX, jt=1),
        _instruction(_RET_K, _errno(EAFNOSUPPORT)),
        _instruction(_RET_K, RET_ALLOW),
    ])
    return b"".join(program)


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture, or None where there is no table."""
    machine = platform.machine() if machine is None else machine
    if machine in ("x86_64", "AMD64", "amd64"):
        return assemble(X86_64, AUDIT_ARCH_X86_64, LAST_REVIEWED)
    return None


def pivot_root_number(machine: str | None = None) -> int | None:
    """The `pivot_root` system call's number (glibc has no wrapper), or None."""
    machine = platform.machine() if machine is None else machine
    return X86_64["pivot_root"] if machine in ("x86_64", "AMD64", "amd64") else None

"""The seccomp policy (`arl.tools.seccomp`): its decisions, by running the classic-BPF
program libseccomp compiled in a small interpreter of the instructions it uses, for
x86_64 and aarch64 (the kernel's own verdicts are in `test_kernel_boundary.py` and
`test_sandbox_escapes.py`)."""

import errno
import os
import struct

import pytest

from arl.tools import seccomp

try:
    import pyseccomp
except Exception:  # pylint: disable=broad-except (no libseccomp.so: RuntimeError)
    pytest.skip("libseccomp is not installed", allow_module_level=True)

ALLOW, KILL_PROCESS, NOTIFY = 0x7FFF0000, 0x80000000, 0x7FC00000
EPERM, ENOSYS = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
THREAD = 0x3D0F00  # glibc's pthread_create flags (CLONE_VM|FS|FILES|SIGHAND|THREAD|...)


def number(name: str, arch: str) -> int:
    return pyseccomp.resolve_syscall(getattr(pyseccomp.Arch, arch.upper()), name)


def run_filter(program: bytes, nr: int, arch: int, args=(0,) * 6) -> int:
    """The action of `program` for one system call (struct seccomp_data: nr, arch,
    instruction pointer, six 64-bit arguments)."""
    args = tuple(args) + (0,) * (6 - len(args))
    data = struct.pack("=iIQ6Q", nr, arch, 0, *[a & 0xFFFFFFFFFFFFFFFF for a in args])
    instructions = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    assert len(instructions) <= 4096
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = instructions[pc]
        pc += 1
        if code == 0x20:    # BPF_LD | BPF_W | BPF_ABS
            accumulator = struct.unpack_from("=I", data, k)[0]
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            accumulator &= k
        elif code in (0x15, 0x25, 0x35, 0x45):  # JEQ, JGT, JGE, JSET with K
            taken = {0x15: accumulator == k, 0x25: accumulator > k, 0x35: accumulator >= k,
                     0x45: bool(accumulator & k)}[code]
            pc += jt if taken else jf
        elif code == 0x05:  # BPF_JMP | BPF_JA
            pc += k
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


def test_the_supervisors_system_call_numbers_match_libseccomps_tables():
    for arch, numbers in seccomp.SYSCALL_NUMBERS.items():
        assert {name: number(name, arch) for name in numbers} == numbers, arch


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_filter_decisions(arch):
    program = seccomp.filter_program(arch)
    audit_arch = AUDIT_ARCH[arch]
    decide = lambda name, *args: run_filter(program, number(name, arch), audit_arch, args)
    present = lambda name: number(name, arch) >= 0
    for name in seccomp.ALLOWED:
        if present(name):
            assert decide(name) == ALLOW, name
    for name in seccomp.REFUSED:
        if present(name):
            assert decide(name) == EPERM, name
    for name in seccomp.EXEC:
        assert decide(name) == NOTIFY, name
    assert decide("clone3") == ENOSYS  # glibc then creates threads with clone
    assert decide("clone", THREAD) == ALLOW
    assert decide("clone", 17) == EPERM                    # fork's SIGCHLD-only clone
    assert decide("clone", 0x4111) == EPERM                # posix_spawn: VM|VFORK
    assert decide("clone", THREAD | 0x10000000) == ENOSYS  # a thread in a new user ns
    for command in (0, 1, 2, 3, 4, 1030, 1032):            # descriptor flags, F_DUPFD
        assert decide("fcntl", 3, command) == ALLOW, command
    for command in (5, 6, 7, 36, 37, 38, 1024, 1026, 1031):  # locks, leases, pipe size
        assert decide("fcntl", 3, command) == EPERM, command
    assert decide("fcntl", 3, 1033) == ENOSYS               # F_ADD_SEALS: not listed
    assert decide("ioctl", 1, 0x5401) == ALLOW              # TCGETS (isatty)
    assert decide("ioctl", 1, 0x5412) == ENOSYS             # TIOCSTI
    assert decide("prlimit64", 0, 7, 0, 0x7FFF0000) == ALLOW  # getrlimit
    assert decide("prlimit64", 0, 7, 0x7FFF0000, 0) == EPERM  # setrlimit
    # Never reviewed: ENOSYS, like a kernel without it.
    for name in ("kexec_load", "init_module", "reboot", "acct", "swapon", "quotactl",
                 "lookup_dcookie", "process_madvise", "set_mempolicy", "landlock_create_ruleset"):
        if present(name):
            assert decide(name) == ENOSYS, name
    assert run_filter(program, 0, 0x40000003) == KILL_PROCESS  # i386
    assert run_filter(program, 0, 0x40000028) == KILL_PROCESS  # 32-bit arm


def test_x32_system_calls_kill_the_process():
    program = seccomp.filter_program("x86_64")
    assert run_filter(program, 0x40000000 + 57, AUDIT_ARCH["x86_64"]) == KILL_PROCESS


def test_every_listed_name_is_a_system_call_on_some_architecture():
    names = (list(seccomp.ALLOWED) + list(seccomp.CONDITIONAL) + list(seccomp.REFUSED)
             + list(seccomp.FALLBACK) + list(seccomp.EXEC))
    for name in names:
        assert max(number(name, arch) for arch in AUDIT_ARCH) >= 0, name
    assert not set(seccomp.ALLOWED) & set(seccomp.REFUSED)


def test_another_architecture_gets_no_filter():
    assert seccomp.filter_program("riscv64") is None
    assert seccomp.syscall_number("pivot_root", "riscv64") is None
    assert seccomp.machine_arch("arm64") == "aarch64"


def test_docs_state_every_entry():
    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "tools.md"),
                encoding="utf-8").read()
    section = docs[docs.index("### The system-call allowlist"):]
    explicit = set(seccomp.ALLOWED) | set(seccomp.CONDITIONAL) | {"clone3"} | set(seccomp.EXEC)
    grouped = {"shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl",
               "semget", "semop", "semctl", "semtimedop", "mq_open", "mq_unlink",
               "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr", "setuid",
               "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid",
               "setfsgid"}  # named there as SysV/POSIX IPC and the set*id calls
    for name in explicit | (set(seccomp.REFUSED) - grouped):
        assert f"`{name}`" in section, name

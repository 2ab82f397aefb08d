"""The seccomp filter (`arl.tools.seccomp`): its system-call numbers against the kernel
headers, and its decisions, by running the assembled classic-BPF program in a small
interpreter of the instructions it uses (the kernel's own verdicts are in
`test_kernel_boundary.py`)."""

import os
import re
import struct

import pytest

from arl.tools import seccomp

HEADER = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"
ALLOW, KILL = seccomp.RET_ALLOW, seccomp.RET_KILL_PROCESS
EPERM = seccomp.RET_ERRNO | seccomp.EPERM
ENOSYS = seccomp.RET_ERRNO | seccomp.ENOSYS
EAFNOSUPPORT = seccomp.RET_ERRNO | seccomp.EAFNOSUPPORT


def run_filter(program: bytes, nr: int, arch: int = seccomp.AUDIT_ARCH_X86_64,
               arg0: int = 0) -> int:
    """The action of `program` for one system call (struct seccomp_data fields)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    instructions = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    assert len(instructions) <= 4096
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = instructions[pc]
        if code == 0x20:
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x25, 0x45):
            taken = {0x15: accumulator == k, 0x25: accumulator > k,
                     0x45: bool(accumulator & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


@pytest.mark.skipif(not os.path.exists(HEADER), reason="no kernel headers here")
def test_system_call_numbers_match_the_kernel_headers():
    with open(HEADER) as f:
        numbers = {m.group(1): int(m.group(2))
                   for m in re.finditer(r"#define __NR_(\w+) (\d+)", f.read())}
    assert {name: numbers[name] for name in seccomp.X86_64} == seccomp.X86_64


def test_filter_decisions():
    program = seccomp.seccomp_filter("x86_64")
    table = seccomp.X86_64
    thread = 0x3D0F00  # glibc's pthread_create flags (CLONE_VM|FS|FILES|SIGHAND|THREAD|...)
    cases = [
        (dict(nr=0), ALLOW),                                   # read
        (dict(nr=table["execve"]), EPERM), (dict(nr=table["fork"]), EPERM),
        (dict(nr=table["vfork"]), EPERM), (dict(nr=table["execveat"]), EPERM),
        (dict(nr=table["clone"], arg0=thread), ALLOW),
        (dict(nr=table["clone"], arg0=17), EPERM),             # fork's SIGCHLD-only clone
        (dict(nr=table["clone"], arg0=0x4111), EPERM),         # posix_spawn: VM|VFORK
        (dict(nr=table["clone"], arg0=thread | 0x10000000), EPERM),  # + CLONE_NEWUSER
        (dict(nr=table["clone3"]), ENOSYS),
        (dict(nr=table["socket"], arg0=1), ALLOW),             # AF_UNIX
        (dict(nr=table["socket"], arg0=2), EAFNOSUPPORT),      # AF_INET
        (dict(nr=table["socket"], arg0=16), EAFNOSUPPORT),     # AF_NETLINK
        (dict(nr=seccomp.LAST_REVIEWED + 1), ENOSYS),
        (dict(nr=0x40000000 + 57), KILL),                      # the x32 ABI
        (dict(nr=2, arch=0x40000003), KILL),                   # i386
    ]
    cases += [(dict(nr=table[name]), EPERM) for name in seccomp.DENIED]
    for fields, expected in cases:
        assert run_filter(program, **fields) == expected, fields
    # Everything else in the reviewed range is allowed.
    listed = set(table.values())
    for nr in range(seccomp.LAST_REVIEWED + 1):
        if nr not in listed:
            assert run_filter(program, nr, arg0=2) == ALLOW, nr


def test_no_table_no_filter():
    assert seccomp.seccomp_filter("aarch64") is None
    assert seccomp.pivot_root_number("aarch64") is None

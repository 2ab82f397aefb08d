"""Which system calls honest programs make in the sandbox's worker: the evidence for the
allowlist in `arl.tools.seccomp` (docs/tools.md). Not a test; run it by hand where
strace is installed (as root):

    python -m tests.tools.trace_syscalls [--seeds 40]

Each program (the honest ones of tests/tools/test_sandbox.py, the code_interpreter
environment's task programs, correct and buggy, and `STANDARD_LIBRARY_TOUR`) runs through
`arl.tools.sandbox.execute` with every layer, but under a filter that allows every system
call (execve still answered once), with the whole call under `strace -f`. The calls of the
worker's process (from its interpreter's execve on, its threads included) are collected
and compared with the policy: used but not allowed (a gap; it would fail with ENOSYS or
EPERM; `clone3` aside, whose ENOSYS makes glibc use `clone`), and allowed but not used
here (kept for a standard-library API the programs did not exercise; docs/tools.md
names it).
"""

import argparse
import collections
import errno
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import pyseccomp

from arl.envs.tasks.code_interpreter import FAMILIES
from arl.tools import sandbox, seccomp

STANDARD_LIBRARY_TOUR = r'''
import collections, json, re, math, decimal, fractions, datetime, time, random, heapq
import itertools, functools, statistics, string, textwrap, io, os, sys, threading, queue
import tempfile, shutil, pathlib, zipfile, gzip, bz2, lzma, csv, hashlib, base64, struct
import select, selectors, signal, resource, locale, unicodedata, difflib, pprint, copy
import dataclasses, enum, typing, array, bisect, operator
os.makedirs("a/b", exist_ok=True)
pathlib.Path("a/b/c.txt").write_text("hello")
shutil.copyfile("a/b/c.txt", "a/d.txt")
shutil.copytree("a", "e")
os.rename("a/d.txt", "a/f.txt")
os.chmod("a/f.txt", 0o600)
os.utime("a/f.txt", (1.7e9, 1.7e9))
print(sorted(os.listdir("a")), os.stat("a/f.txt").st_size, os.path.realpath("a/../a"))
with zipfile.ZipFile("z.zip", "w") as z:
    z.write("a/f.txt")
with gzip.open("g.gz", "wt") as g:
    g.write("x" * 1000)
print(zipfile.ZipFile("z.zip").namelist(), len(gzip.open("g.gz").read()))
with tempfile.TemporaryDirectory(dir=".") as d, tempfile.NamedTemporaryFile(dir=d) as f:
    f.write(b"x"); f.flush(); os.fsync(f.fileno())
os.remove("e/d.txt")
q = queue.Queue()
threads = [threading.Thread(target=lambda i=i: q.put(sum(range(i * 1000)))) for i in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
print(sorted(q.get() for _ in range(4))[-1])
r, w = os.pipe()
os.set_blocking(r, False)
os.write(w, b"ping")
print(select.select([r], [], [], 0.1)[0] == [r], os.read(r, 4))
with selectors.DefaultSelector() as s:
    s.register(r, selectors.EVENT_READ)
    print(s.select(0.01))
time.sleep(0.01)
print(time.time() > 0, time.monotonic() > 0, time.process_time() >= 0, time.perf_counter())
print(random.random() < 1, os.urandom(4).__len__(), hashlib.sha256(b"x").hexdigest()[:8])
print(decimal.Decimal(1) / 3, fractions.Fraction(1, 3), datetime.datetime.now().year > 2000)
print(os.getpid() > 0, os.getcwd(), os.cpu_count(), resource.getrlimit(resource.RLIMIT_AS))
print(os.isatty(1), shutil.get_terminal_size(), locale.getpreferredencoding(False))
signal.signal(signal.SIGALRM, lambda *a: None)
signal.setitimer(signal.ITIMER_REAL, 0.01)
time.sleep(0.05)
print(sys.getrecursionlimit(), unicodedata.name("é"),
      difflib.SequenceMatcher(a="ab", b="ac").ratio())
big = bytearray(50 * 2**20); del big
print(statistics.mean([1, 2, 3]), json.dumps({"a": [1, 2]}), csv.writer(io.StringIO()))
'''


def programs(seeds: int) -> dict:
    from tests.tools import test_sandbox  # pylint: disable=import-outside-toplevel
    honest = ("sum", "zero_division", "non_utf8", "exit_3", "syntax_error", "work_files",
              "big_file", "long_output", "stdlib_imports", "environ", "print_loop",
              "sleep_forever", "list_bomb")
    cases = {name: code for name, (code, _) in test_sandbox.programs(0, 0).items()
             if name in honest}
    for family, make in FAMILIES.items():
        for seed in range(seeds):
            _, solution, buggy, _ = make(random.Random(seed))
            cases[f"{family} {seed}"] = solution
            cases[f"{family} {seed} buggy"] = buggy
    cases["standard library tour"] = STANDARD_LIBRARY_TOUR
    return cases


def _observing_filter() -> str:
    """Every system call allowed; execve notifies, as in the real policy."""
    policy = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in seccomp.EXEC:
        policy.add_rule(pyseccomp.NOTIFY, name)
    with tempfile.TemporaryFile() as exported:
        policy.export_bpf(exported)
        exported.seek(0)
        return exported.read().hex()


_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")


def worker_calls(trace_path: str) -> collections.Counter:
    """System calls of the worker: from the last successful execve on, in that process and
    the threads it created."""
    with open(trace_path, errors="replace") as f:
        lines = f.read().splitlines()
    start = max(i for i, line in enumerate(lines)
                if re.match(r"\d+\s+(execve\(|<\.\.\. execve resumed>)", line)
                and line.rstrip().endswith("= 0"))
    # After that execve only the worker makes new tasks (its threads): every task first
    # seen from there on is one of them.
    earlier = {line.split()[0] for line in lines[:start] if line.split()}
    worker = lines[start].split()[0]
    calls = collections.Counter()
    for line in lines[start + 1:]:
        match = _LINE.match(line)
        if not match or (match.group(1) != worker and match.group(1) in earlier):
            continue
        if match.group(3):  # the call's first line (a resumed one is counted already)
            calls[match.group(3)] += 1
    return calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    strace = shutil.which("strace")
    if strace is None:
        sys.exit("strace is not installed (apt-get install strace)")
    capabilities = sandbox.sandbox_capabilities()
    sandbox._seccomp_hex = _observing_filter  # pylint: disable=protected-access
    popen = subprocess.Popen
    used = collections.Counter()
    with tempfile.TemporaryDirectory() as directory:
        trace = os.path.join(directory, "trace")

        def traced(command, **kwargs):
            return popen([strace, "-f", "-qq", "-o", trace] + list(command), **kwargs)

        subprocess.Popen = traced
        try:
            for name, code in programs(args.seeds).items():
                limits = sandbox.SandboxLimits(wall_time_s=10.0, memory_bytes=256 * 2**20)
                result = sandbox.execute(code, limits, os.path.realpath(sys.executable),
                                         capabilities, audit_hooks=True)
                if result.status is sandbox.Status.INTERNAL_ERROR:
                    sys.exit(f"{name}: {result.observation}")
                if name == "standard library tour" and not result.ok:
                    sys.exit(f"{name} failed: {result.observation}")
                used.update(worker_calls(trace))
        finally:
            subprocess.Popen = popen
    allowed = set(seccomp.ALLOWED) | set(seccomp.CONDITIONAL)
    print("used (calls):", ", ".join(f"{n} {c}" for n, c in sorted(used.items())))
    gaps = set(used) - allowed - set(seccomp.EXEC) - set(seccomp.FALLBACK)
    print("used, not allowed:", sorted(gaps))
    print("allowed, not used here:", sorted(allowed - set(used)))
    return errno.EINVAL if gaps else 0


if __name__ == "__main__":
    sys.exit(main())

"""Escapes past the layers the program could once switch off or go around: each class
run with every layer (`run_python`) and with the audit hooks off (`sandbox.execute(...,
audit_hooks=False)`), where this machine has the kernel boundary.

* the audit hooks, through an FFI the program finds already loaded: no `ctypes` (or
  libffi) in the program's process to walk to the hook's closure with;
* kernel memory outside RLIMIT_AS: socket buffers (no socket, no socketpair), pipe
  buffers (no F_SETPIPE_SZ; at most `max_open_files` default-sized pipes);
* system calls a default-allow filter let through: locks and leases on the inodes the
  sandbox shares with the trainer (a covert channel: here the trainer holds a lock on
  /dev/null while the program probes it), and the rest of what a process may try
  (setsid, affinity, priority, FIFOs, links, owners, memfds, pidfds, splice, eventfd,
  execve after the worker's own, interrupting its supervisor or process group);
* the host's metadata: times and mode of /dev/null and of the standard library, writes
  to /dev/urandom.
"""

import ast
import dataclasses
import fcntl
import os
import sys

import pytest

from arl.tools import ToolPool, sandbox
from arl.tools.limits import SandboxLimits
from arl.tools.results import Status
from tests.tools.conftest import other_python

PYTHON = os.path.realpath(sys.executable)
CAPABILITIES = sandbox.sandbox_capabilities()
pytestmark = pytest.mark.skipif(not CAPABILITIES.kernel_boundary,
                                reason=f"no kernel boundary here ({CAPABILITIES.describe()})")
LIMITS = SandboxLimits(wall_time_s=20.0, cpu_time_s=5.0, max_open_files=64)
STDLIB_FILE = os.path.realpath(os.__file__)

PRELUDE = '''import os, sys
out = {}
def attempt(name, fn):
    try:
        out[name] = "ok " + repr(fn())[:120]
    except BaseException as error:
        out[name] = type(error).__name__ + " " + str(error)[:120]
'''

# Every type reachable from `object` without an audit event: a native-call type (ctypes'
# CFuncPtr, a cffi backend) among them would let the program patch the hook's closure.
FFI_REACHABLE = PRELUDE + '''
def every_type():
    seen, pending = set(), [object]
    while pending:
        for sub in type.__subclasses__(pending.pop()):
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
    return seen
types = every_type()
out["ffi types"] = sorted(t.__module__ + "." + t.__qualname__ for t in types
                          if any(n in (t.__module__ or "") for n in ("ctypes", "cffi", "ffi")))
out["ffi modules"] = sorted(m for m in sys.modules if "ctypes" in m or "ffi" in m)
out["types"] = len(types)
def loaded_libraries():
    with open("/proc/self/maps") as f:
        names = {line.split()[-1].rsplit("/", 1)[-1] for line in f if ".so" in line}
    return any(n.startswith("libc.so") for n in names), sorted(n for n in names if "ffi" in n)
attempt("maps", loaded_libraries)
attempt("import ctypes", lambda: __import__("ctypes"))
def by_file():
    import glob, importlib.util
    path = glob.glob(os.path.dirname(os.__file__) + "/lib-dynload/_ctypes.*.so")[0]
    spec = importlib.util.spec_from_file_location("innocent", path)
    return importlib.util.module_from_spec(spec)
attempt("_ctypes by file", by_file)
attempt("hook still there", lambda: open("/etc/hostname").read())
print(repr(out))
'''

KERNEL_MEMORY = PRELUDE + '''import fcntl
def unix_socket():
    import _socket
    return _socket.socket(1, 1)
def socket_pair():
    import _socket
    return _socket.socketpair()
attempt("socket", unix_socket)
attempt("socketpair", socket_pair)
attempt("grow a pipe", lambda: fcntl.fcntl(os.pipe()[1], 1031, 2**20))  # F_SETPIPE_SZ
def fill_pipes():
    held = 0
    try:
        while True:
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)
            try:
                while True:
                    held += os.write(write_end, b"x" * 65536)
            except BlockingIOError:
                pass
    except OSError as error:  # out of descriptors
        return held, error.errno
attempt("pipes", fill_pipes)
print(repr(out))
'''

LOCKS_AND_STRAY_CALLS = PRELUDE + f'''import fcntl, signal, stat
null = os.open("/dev/null", os.O_RDONLY)
library_file = open({STDLIB_FILE!r}, "rb")  # the hooks let the program read the library
library = library_file.fileno()
mine = os.open("mine", os.O_CREAT | os.O_RDWR)
attempt("flock /dev/null", lambda: fcntl.flock(null, fcntl.LOCK_EX | fcntl.LOCK_NB))
attempt("flock library", lambda: fcntl.flock(library, fcntl.LOCK_SH | fcntl.LOCK_NB))
attempt("lockf own file", lambda: fcntl.lockf(mine, fcntl.LOCK_EX | fcntl.LOCK_NB))
attempt("F_GETLK /dev/null", lambda: fcntl.fcntl(null, fcntl.F_GETLK, bytes(32)))
attempt("lease library", lambda: fcntl.fcntl(library, 1024, 0))  # F_SETLEASE, F_RDLCK
attempt("F_NOTIFY", lambda: fcntl.fcntl(os.open(".", os.O_RDONLY), 1026, 0x80000001))
attempt("setsid", os.setsid)
attempt("setpgid", lambda: os.setpgid(0, 0))
attempt("sched_setaffinity", lambda: os.sched_setaffinity(0, {{0}}))
attempt("setpriority", lambda: os.setpriority(os.PRIO_PROCESS, 0, 19))
attempt("mkfifo", lambda: os.mkfifo("fifo"))
attempt("link", lambda: os.link("mine", "hard"))
attempt("chown", lambda: os.chown("mine", 0, 0))
attempt("memfd", lambda: os.memfd_create("m"))
attempt("eventfd", lambda: os.eventfd(0))
attempt("pidfd_open", lambda: os.pidfd_open(os.getpid()))
attempt("splice", lambda: os.splice(mine, os.pipe()[1], 1))
attempt("setrlimit", lambda: __import__("resource").setrlimit(
    __import__("resource").RLIMIT_NOFILE, (16, 16)))
attempt("getrlimit", lambda: __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE))
attempt("execv", lambda: os.execv(sys.executable, [sys.executable, "-c", "0"]))
attempt("posix_spawn", lambda: os.posix_spawn(sys.executable, [sys.executable], {{}}))
attempt("thread", lambda: __import__("threading").Thread(target=lambda: 0).start())
attempt("isatty", lambda: os.isatty(1))
signal.signal(signal.SIGINT, lambda *_: None)  # the program's own copy of what it sends
attempt("interrupt the supervisor", lambda: os.kill(1, signal.SIGINT))
attempt("interrupt the group", lambda: os.killpg(0, signal.SIGINT))
attempt("set_inheritable", lambda: os.set_inheritable(mine, True))
print(repr(out))
'''

HOST_METADATA = PRELUDE + f'''
attempt("utime /dev/null", lambda: os.utime("/dev/null", (0, 0)))
attempt("utime now /dev/null", lambda: os.utime("/dev/null"))
attempt("chmod /dev/null", lambda: os.chmod("/dev/null", 0o600))
attempt("utime library", lambda: os.utime({STDLIB_FILE!r}, (0, 0)))
attempt("write /dev/null", lambda: os.write(os.open("/dev/null", os.O_WRONLY), b"x"))
attempt("write /dev/urandom", lambda: os.write(os.open("/dev/urandom", os.O_WRONLY), b"x"))
attempt("urandom", lambda: len(os.urandom(16)))
print(repr(out))
'''

CASES = {
    "ffi_reachable": FFI_REACHABLE,
    "kernel_memory": KERNEL_MEMORY,
    "locks_and_stray_calls": LOCKS_AND_STRAY_CALLS,
    "host_metadata": HOST_METADATA,
}


def _times(path):
    info = os.stat(path)
    return info.st_atime_ns, info.st_mtime_ns, info.st_ctime_ns, info.st_mode


@pytest.fixture(scope="module")
def results():
    """Every case with and without the hooks, in parallel, while this process holds an
    exclusive lock on /dev/null (the program must not be able to tell)."""
    before = {path: _times(path) for path in ("/dev/null", STDLIB_FILE)}
    cases = [(name, hooks) for name in CASES for hooks in (True, False)]
    with open("/dev/null", "rb") as null, ToolPool(8) as pool:
        fcntl.flock(null, fcntl.LOCK_EX)
        outcome = pool.map(lambda case: sandbox.execute(
            CASES[case[0]], LIMITS, PYTHON, CAPABILITIES, audit_hooks=case[1]), cases)
    after = {path: _times(path) for path in before}
    return dict(zip(cases, outcome)), before, after


def attempts(result) -> dict:
    assert result.status is Status.OK, result
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


EPERM = "PermissionError [Errno 1]"
ENOSYS = "OSError [Errno 38]"
HOOK = "PermissionError sandbox"


@pytest.mark.parametrize("hooks", [True, False], ids=["all_layers", "kernel_only"])
def test_no_ffi_is_reachable_to_switch_the_hooks_off(results, hooks):
    out = attempts(results[0]["ffi_reachable", hooks])
    assert out["ffi types"] == [] and out["ffi modules"] == [], out
    assert out["types"] > 200, out  # the walk did reach the interpreter's types
    if hooks:
        assert out["import ctypes"].startswith(HOOK + ": module 'ctypes'"), out
        assert out["_ctypes by file"].startswith(HOOK), out
        assert out["hook still there"].startswith(HOOK + ": reading '/etc/hostname'"), out
    else:
        assert out["maps"] == "ok (True, [])", out  # libc mapped, no libffi
        # ctypes' extension cannot load: its libffi is not in the root
        assert out["import ctypes"].startswith("ImportError libffi"), out


@pytest.mark.parametrize("hooks", [True, False], ids=["all_layers", "kernel_only"])
def test_kernel_memory_outside_rlimit_as_is_bounded(results, hooks):
    out = attempts(results[0]["kernel_memory", hooks])
    refusal = HOOK + ": module '_socket'" if hooks else EPERM
    assert out["socket"].startswith(refusal) and out["socketpair"].startswith(refusal), out
    assert out["grow a pipe"].startswith(EPERM), out
    held, error = ast.literal_eval(out["pipes"][3:])
    assert error == 24  # EMFILE: the descriptors ran out first
    pipes = LIMITS.max_open_files // 2
    assert 0 < held <= pipes * 65536, out  # default-sized buffers only


@pytest.mark.parametrize("hooks", [True, False], ids=["all_layers", "kernel_only"])
def test_locks_and_stray_system_calls_are_refused(results, hooks):
    out = attempts(results[0]["locks_and_stray_calls", hooks])
    if hooks:
        assert out["flock /dev/null"].startswith(HOOK + ": fcntl.flock"), out
        assert out["lockf own file"].startswith(HOOK + ": fcntl.lockf"), out
    else:
        # EPERM, not "resource busy": the trainer's lock on /dev/null is invisible
        for name in ("flock /dev/null", "flock library", "lockf own file"):
            assert out[name].startswith(EPERM), (name, out)
    for name in ("F_GETLK /dev/null", "lease library", "F_NOTIFY"):
        assert out[name].startswith(EPERM), (name, out)
    for name in ("setsid", "setpgid", "sched_setaffinity", "setpriority", "mkfifo", "link",
                 "chown", "memfd", "splice"):
        assert out[name].startswith((EPERM, HOOK)), (name, out)
    # CPython reports setrlimit's EPERM as this ValueError
    assert out["setrlimit"].startswith((HOOK, "ValueError not allowed to raise")), out
    assert out["eventfd"].startswith(ENOSYS), out          # never listed
    assert out["pidfd_open"].startswith("AttributeError" if hooks else EPERM), out
    if hooks:
        assert out["execv"].startswith(HOOK + ": os.exec"), out
    else:
        assert out["execv"].startswith(ENOSYS), out  # the listener went with the first
    assert out["posix_spawn"].startswith((EPERM, HOOK)), out
    # what honest programs use still works
    assert out["getrlimit"] == "ok (64, 64)", out
    assert out["thread"] == "ok None" and out["isatty"] == "ok False", out
    assert out["set_inheritable"] == "ok None", out
    if not hooks:  # signals reach no one but the program: its call still ends normally
        assert out["interrupt the supervisor"].startswith(("ok", EPERM)), out
        assert out["interrupt the group"] == "ok None", out


@pytest.mark.parametrize("hooks", [True, False], ids=["all_layers", "kernel_only"])
def test_the_hosts_device_and_library_metadata_stay_unchanged(results, hooks):
    out = attempts(results[0]["host_metadata", hooks])
    for name in ("utime /dev/null", "utime now /dev/null", "chmod /dev/null"):
        assert out[name].startswith("OSError [Errno 30] Read-only file system"), (name, out)
    assert out["utime library"].startswith(
        HOOK if hooks else "OSError [Errno 30] Read-only file system"), out
    assert out["write /dev/null"] == "ok 1", out  # writing the device itself is harmless
    assert out["write /dev/urandom"].startswith(
        HOOK if hooks else "FileNotFoundError"), out  # not in the root
    assert out["urandom"] == "ok 16", out  # getrandom(2)
    _, before, after = results
    assert after == before  # /dev/null's and the library file's times and mode


@pytest.mark.skipif(other_python() is None, reason="no other python3 on this machine")
def test_no_ffi_with_the_machines_own_python_either():
    python = other_python()
    result = sandbox.execute(FFI_REACHABLE, LIMITS, python,
                             sandbox.sandbox_capabilities(python), audit_hooks=False)
    out = attempts(result)
    assert out["ffi types"] == [] and out["ffi modules"] == [], out
    assert out["maps"] == "ok (True, [])", out


SIGNALS = '''import os, signal
signal.signal(signal.SIGINT, lambda *_: None)  # the program's own copy of what it sends
os.kill(1, signal.SIGINT)     # its supervisor, PID 1 of the namespace
os.killpg(0, signal.SIGINT)   # its process group
print("alive")
'''


def test_signals_from_a_program_of_the_same_uid_reach_only_itself():
    """In the user-namespace mode (a non-root trainer) the program has the uid of its
    supervisor and of `unshare`: it must still not be able to interrupt them and turn
    its own call into a sandbox error."""
    same_uid = dataclasses.replace(CAPABILITIES, user_namespace=True, uid_drop=False)
    result = sandbox.execute(SIGNALS, LIMITS, PYTHON, same_uid, audit_hooks=False)
    assert result.status is Status.OK and result.stdout == "alive\n", result

"""Run an untrusted Python program (a policy's tool call) and return an observation.

`run_python(code, limits=SandboxLimits())` executes `code` in a fresh interpreter
(``python -I -S -B -u -X utf8``: isolated mode, no site-packages, standard library only)
in a separate process and returns an `ExecutionResult`: its stdout, stderr, exit status,
how it ended (`Status`), its wall time and the `observation` text a policy reads
("45\\n", "ZeroDivisionError: division by zero", "timeout after 1.0 s",
"memory limit exceeded (256 MiB)", ...). Whatever the program does, the caller gets a
result, never an exception; only bad arguments (a non-str `code`, a bad limit) raise.

Threat model: the program is adversarial (written by a policy being trained, so it will
find whatever the reward rewards). It must not harm the training process, the machine or
other runs, read the run's secrets, or use the network. The boundary is the kernel
(where `sandbox_capabilities().kernel_boundary`; docs/tools.md has the guarantees per
layer and what is not guaranteed):

* `unshare` gives the call network, PID, mount, IPC and UTS namespaces; the supervisor
  (`arl.tools._sandbox_child`, PID 1 there) `pivot_root`s into a minimal root
  (`arl.tools.rootfs`: the interpreter, the standard library and the libraries it links,
  read-only; /dev/null, read-only; a private /proc; one tmpfs of `max_disk_bytes` at
  /tmp, the working directory and the only writable place) and forks its child;
* the child sets the resource limits, drops to an ephemeral unprivileged uid (as root),
  installs the seccomp allowlist (`arl.tools.seccomp`: the system calls a
  standard-library program needs; no process, no socket, no lock, no mknod, mount,
  namespace, ptrace, ...) and executes a fresh interpreter, the worker
  (`arl.tools._sandbox_worker`): no `ctypes` or other FFI is loaded there. The worker
  installs the audit hooks (PEP 578; the friendly first layer, with clear
  `PermissionError("sandbox: ...")` refusals; not a boundary on their own) and runs the
  program, while the supervisor enforces the wall-time limit;
* always: a new process group SIGKILLed when the call ends, an empty environment, only
  stdin (/dev/null), stdout and stderr open, at most `max_output_bytes` read per pipe,
  the wall-time limit enforced by the supervisor and, 1 s later, by the parent.

Where a kernel layer is unavailable, `sandbox_capabilities` settles for the strongest
candidate that works and says which; `code_interpreter` refuses such a machine unless
its config accepts the weaker mode.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import random
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from arl.tools import rootfs, seccomp
from arl.tools._sandbox_worker import BLOCKED_MODULES
from arl.tools.capabilities import SandboxCapabilities, candidate_capabilities, resolve_python
from arl.tools.limits import SandboxLimits
from arl.tools.results import (ExecutionResult, Status, compose_observation, format_seconds,
                               internal_error_result)

_log = logging.getLogger(__name__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_KERNEL_SOURCE_PATH = os.path.join(_HERE, "_sandbox_kernel.py")
_WORKER_SOURCE_PATH = os.path.join(_HERE, "_sandbox_worker.py")
_CHILD_SOURCE_PATH = os.path.join(_HERE, "_sandbox_child.py")
_BACKSTOP_GRACE_S = 1.0  # parent's kill comes this long after the supervisor's
_MiB = 2 ** 20

# Imported by the worker before the program runs, from cached bytecode, so the program
# finds them loaded (it compiles any other module from source: no cached bytecode).
PRELOADED_MODULES = ("collections", "re", "math", "itertools", "functools", "json",
                     "random", "string", "heapq", "bisect", "statistics", "fractions",
                     "decimal", "datetime", "operator", "copy")


# --------------------------------------------------------------------------- isolation


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=1)
def _supervisor_source() -> str:
    """The kernel helpers' and the supervisor's source (one `-c` program)."""
    return "\n".join(_read(p) for p in (_KERNEL_SOURCE_PATH, _CHILD_SOURCE_PATH))


@functools.lru_cache(maxsize=1)
def _worker_source() -> str:
    """The worker's source: the `-c` program of its executed interpreter, or (without a
    kernel layer) run by the supervisor's child in its own process."""
    return _read(_WORKER_SOURCE_PATH)


@functools.lru_cache(maxsize=1)
def _seccomp_hex() -> str:
    return seccomp.filter_program().hex()


_WORK_INODES = 4096  # files and directories the program may create


def _work_options(limits: SandboxLimits, uid: int | None) -> str:
    """The tmpfs options of the working directory: its size is `max_disk_bytes`."""
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    return f"size={limits.max_disk_bytes},nr_inodes={_WORK_INODES},mode=0700{owner}"


_UID_RANGE = (1_500_000_000, 2_000_000_000)
_uid_random = random.SystemRandom()


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    cpu = max(1, int(-(-limits.cpu_time_s // 1)))
    return {
        "CORE": (0, 0),
        "CPU": (cpu, cpu + 1),
        "AS": (limits.memory_bytes, limits.memory_bytes),
        "FSIZE": (limits.max_file_bytes, limits.max_file_bytes),
        "NOFILE": (limits.max_open_files, limits.max_open_files),
        "NPROC": (limits.max_processes, limits.max_processes),
    }


# ------------------------------------------------------------------------------- running


_capabilities_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _probe_capabilities(python: str) -> SandboxCapabilities:
    limits = SandboxLimits(wall_time_s=10.0)
    failures = []
    for candidate in candidate_capabilities():
        for _ in range(2):  # a second try, so that a transient failure does not weaken it
            result = execute("print(6 * 7)", limits, python, candidate, audit_hooks=True)
            if result.status is Status.OK and result.stdout == "42\n":
                if failures:
                    _log.warning("arl.tools.sandbox: using the weaker isolation %s; stronger "
                                 "candidates failed: %s", candidate, "; ".join(failures))
                return candidate
        failures.append(f"{candidate.unshare_args or 'no namespaces'}: {result.observation}")
    _log.error("arl.tools.sandbox: no isolation works with %s: %s", python, "; ".join(failures))
    return SandboxCapabilities()  # the last resort: each result will say what fails


def sandbox_capabilities(python: str | None = None) -> SandboxCapabilities:
    """The isolation `run_python` uses with interpreter `python` (default: this one).
    The first call probes the candidates of `arl.tools.capabilities` from strongest to
    weakest (a trivial program through each until one works); later calls are cached."""
    python = resolve_python(python)
    with _capabilities_lock:
        return _probe_capabilities(python)



def run_python(code: str, *, limits: SandboxLimits = SandboxLimits(),
               python: str | None = None) -> ExecutionResult:
    """Runs the Python program `code` in the sandbox (module docstring) and returns its
    `ExecutionResult`. Never raises for anything the program does; raises TypeError /
    ValueError for a non-str `code`, non-`SandboxLimits` `limits` or a bad `python`
    (path of the interpreter to use, default: this one; its standard library only).
    Thread-safe (no `preexec_fn`): calls may run concurrently, see `arl.tools.pool`."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    python = resolve_python(python)
    if len(code) > limits.max_code_chars:
        return ExecutionResult(
            observation=f"program longer than {limits.max_code_chars} characters; not run",
            status=Status.ERROR)
    capabilities = sandbox_capabilities(python)
    return execute(code, limits, python, capabilities, audit_hooks=True)


def execute(code: str, limits: SandboxLimits, python: str,
            capabilities: SandboxCapabilities, audit_hooks: bool) -> ExecutionResult:
    """`run_python` with the isolation chosen explicitly, no argument checks (the probe
    of `sandbox_capabilities` and the tests use it, e.g. to check the kernel layers
    without the audit hooks)."""
    start = time.monotonic()
    workdir = None
    try:
        workdir = tempfile.mkdtemp(prefix="arl-sandbox-")
        os.chmod(workdir, 0o755 if capabilities.uid_drop else 0o700)
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8",
                  errors="surrogatepass") as f:
            f.write(code)
        uid = _uid_random.randrange(*_UID_RANGE) if capabilities.uid_drop else None
        return _spawn_and_collect(workdir, limits, python, capabilities, audit_hooks, uid,
                                  start)
    except Exception as exc:  # the sandbox failed (e.g. no memory to fork): report it
        return internal_error_result(f"{type(exc).__name__}: {exc}",
                                     time.monotonic() - start)
    finally:
        if workdir is not None:
            _remove_tree(workdir)


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, failed_path, _):
        try:
            os.chmod(os.path.dirname(failed_path), 0o700)
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                os.chmod(failed_path, 0o700)
            function(failed_path)
        except OSError:
            pass
    shutil.rmtree(path, onerror=make_writable_and_retry)


def _spawn_and_collect(workdir, limits, python, capabilities, audit_hooks, uid, start):
    status_read, status_write = os.pipe()
    config = {
        "workdir": workdir,
        "status_fd": status_write,
        "wall_time_s": float(limits.wall_time_s),
        "rlimits": _rlimits(limits),
        "uid": uid,
        "root": (rootfs.root_plan(python, BLOCKED_MODULES).to_json()
                 if capabilities.mount_namespace else None),
        "work_options": _work_options(limits, uid),
        "pivot_root": seccomp.syscall_number("pivot_root"),
        "seccomp": _seccomp_hex() if capabilities.seccomp else None,
        "seccomp_number": seccomp.syscall_number("seccomp"),
        "python": python,
        "worker_source": _worker_source(),
        "worker": {"audit": audit_hooks, "preload": list(PRELOADED_MODULES)},
        # without a PID namespace the parent's group kill must reach the program
        "own_session": capabilities.pid_namespace,
    }
    command = list(capabilities.unshare_args) + [
        python, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", _supervisor_source(),
        json.dumps(config)]
    try:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=workdir, env={}, close_fds=True,
            pass_fds=(status_write,), start_new_session=True)
    except BaseException:
        os.close(status_read)
        raise
    finally:
        os.close(status_write)
    try:
        collected = _collect(process, status_read, limits,
                             deadline=start + limits.wall_time_s + _BACKSTOP_GRACE_S)
    finally:
        _kill_group(process)
        process.wait()
        os.close(status_read)
        process.stdout.close()
        process.stderr.close()
    return _result(collected, limits, process.returncode, time.monotonic() - start)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the call's process group. Safe from pid reuse: the group leader is our
    unreaped child, so its id (the group id) cannot have been recycled."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclasses.dataclass
class _Collected:
    stdout: bytearray
    stderr: bytearray
    status_line: str
    output_exceeded: bool
    backstop_timeout: bool


def _exit_watcher(process: subprocess.Popen):
    """A pollable fd that becomes readable when `process` exits (without reaping it),
    or None where pidfd_open is unavailable."""
    try:
        return os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        return None


def _has_exited(process: subprocess.Popen) -> bool:
    try:
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _collect(process, status_read, limits, deadline) -> _Collected:
    """Reads stdout, stderr (each up to max_output_bytes) and the status pipe until the
    process exits, the output limit is hit or the backstop deadline passes."""
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    status = bytearray()
    output_exceeded = backstop_timeout = False
    pidfd = _exit_watcher(process)
    selector = selectors.DefaultSelector()
    try:
        for fd in list(buffers) + [status_read]:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ)
        open_fds = set(buffers) | {status_read}
        exited = False
        while not exited and not output_exceeded:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                backstop_timeout = True
                break
            timeout = remaining if pidfd is not None else min(remaining, 0.01)
            for key, _ in selector.select(timeout):
                if key.fd == pidfd:
                    exited = True
                    continue
                output_exceeded |= _read_available(key.fd, buffers, status, limits,
                                                   open_fds, selector)
            if pidfd is None:
                exited = _has_exited(process)
            if not open_fds:
                exited = True  # every pipe closed: only the exit status is left
        if exited and not output_exceeded:
            # Its writes are all in the pipes now; anything still running (only possible
            # without a PID namespace) is killed with the group right after.
            for fd in list(open_fds):
                output_exceeded |= _read_available(fd, buffers, status, limits, open_fds,
                                                   selector, drain=True)
    finally:
        selector.close()
        if pidfd is not None:
            os.close(pidfd)
    return _Collected(buffers[process.stdout.fileno()], buffers[process.stderr.fileno()],
                      status.decode("utf-8", "replace"), output_exceeded, backstop_timeout)


def _read_available(fd, buffers, status, limits, open_fds, selector, drain=False) -> bool:
    """Reads what `fd` has (all of it when `drain`); True if an output pipe went over
    max_output_bytes (the excess is dropped, never buffered)."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.EBADF):
                raise
            chunk = b""
        if not chunk:
            open_fds.discard(fd)
            try:
                selector.unregister(fd)
            except KeyError:
                pass
            return False
        if fd in buffers:
            buffer = buffers[fd]
            room = limits.max_output_bytes - len(buffer)
            buffer += chunk[:max(room, 0)]
            if len(chunk) > room:
                return True
        elif len(status) < 4096:
            status += chunk
        if not drain:
            return False


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_lines(text: str, count: int) -> str:
    lines = [line for line in text.rstrip("\n").split("\n") if line.strip()]
    return "\n".join(lines[-count:])


def _result(collected: _Collected, limits: SandboxLimits, returncode: int | None,
            wall_time_s: float) -> ExecutionResult:
    stdout = collected.stdout.decode("utf-8", "replace")
    stderr = collected.stderr.decode("utf-8", "replace")
    kind, _, detail = collected.status_line.strip().partition(" ")
    kind = kind or None
    tail = _last_lines(stderr, limits.traceback_lines)
    last_line = _last_lines(stderr, 1)
    exit_code = None
    truncated = False

    if collected.output_exceeded:
        status = Status.OUTPUT_LIMIT
        line = f"output limit exceeded (more than {limits.max_output_bytes} bytes)"
        truncated = True
    elif kind == "timeout" or (kind is None and collected.backstop_timeout):
        status, line = Status.TIMEOUT, f"timeout after {format_seconds(limits.wall_time_s)} s"
    elif kind == "exit":
        exit_code = int(detail.split()[0])
        if exit_code == 0:
            status, line = Status.OK, None
        elif last_line.startswith("MemoryError"):
            status = Status.MEMORY_LIMIT
            line = f"memory limit exceeded ({_format_bytes(limits.memory_bytes)})"
        elif "[Errno 27] File too large" in last_line or "[Errno 28] No space left" in last_line:
            status = Status.FILE_SIZE_LIMIT
            line = tail + "\nfile size limit exceeded"
        else:
            status = Status.ERROR
            line = tail if tail else f"exit status {exit_code}"
    elif kind == "signal":
        number, cpu_seconds = int(detail.split()[0]), float(detail.split()[1])
        exit_code = -number
        cpu_limit = _rlimits(limits)["CPU"][0]
        if last_line.startswith("MemoryError"):
            # The program was dying of the memory limit (its traceback is the last thing
            # it wrote) when the CPU limit or a kill caught up with it: on a loaded host,
            # faulting in the memory can use most of the CPU allowance.
            status = Status.MEMORY_LIMIT
            line = f"memory limit exceeded ({_format_bytes(limits.memory_bytes)})"
        elif number == signal.SIGXCPU or (number == signal.SIGKILL and cpu_seconds >= cpu_limit):
            status = Status.CPU_LIMIT
            line = f"cpu time limit exceeded ({cpu_limit} s)"
        elif number == signal.SIGXFSZ:
            status, line = Status.FILE_SIZE_LIMIT, "file size limit exceeded"
        elif "MemoryError" in stderr:
            status = Status.MEMORY_LIMIT
            line = f"memory limit exceeded ({_format_bytes(limits.memory_bytes)})"
        else:
            status, line = Status.KILLED, f"killed by {_signal_name(number)}"
    elif kind == "error":
        return internal_error_result(detail, wall_time_s)
    else:
        detail = _last_lines(stderr, 3) or f"exit code {returncode}"
        return internal_error_result(f"no status from the sandbox ({detail})", wall_time_s)

    body = stdout
    observation, cut = compose_observation(body, line, limits.max_observation_chars)
    if status is Status.OK and not observation:
        observation = "(no output)"
    return ExecutionResult(observation=observation, status=status, stdout=stdout,
                           stderr=stderr, exit_code=exit_code, wall_time_s=wall_time_s,
                           output_truncated=truncated or cut)


def _format_bytes(count: int) -> str:
    if count % _MiB == 0:
        return f"{count // _MiB} MiB"
    return f"{count} bytes"

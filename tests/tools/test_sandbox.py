"""`arl.tools.sandbox.run_python` against what an adversarial policy would write.

Each program must come back as an observation within its limits, with this process
alive and unaffected (`conftest.parent_unaffected` checks that after every test). The
adversarial programs run once, in parallel, in the module fixture `results`; the tests
then check each result. Programs that test a kernel layer on its own run with the audit
hooks off (`sandbox.execute(..., audit_hooks=False)`), where this machine has that layer.
"""

import dataclasses
import dis
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from arl.tools import ToolPool, sandbox
from arl.tools import results as results_lib
from arl.tools import _sandbox_worker as child
from arl.tools.limits import SandboxLimits
from arl.tools.results import Status
from arl.tools.sandbox import run_python
from tests.tools.conftest import SECRET_NAME, SECRET_VALUE

# Programs that end by themselves get a wall limit they never need, so that a loaded
# machine (this batch runs ~45 programs at once) cannot turn their outcome into a timeout;
# SHORT is for the programs that are meant to time out.
QUICK = SandboxLimits(wall_time_s=10.0, cpu_time_s=1.0, memory_bytes=256 * 2**20)
SHORT = dataclasses.replace(QUICK, wall_time_s=1.0)
# The memory and output bombs must hit their own limit, not the CPU one: under that load
# filling 256 MiB or the output cap has taken over a second of CPU (page faults count).
BOMB = dataclasses.replace(QUICK, cpu_time_s=5.0)
PYTHON = os.path.realpath(sys.executable)
CAPABILITIES = sandbox.sandbox_capabilities()
NO_SECCOMP = dataclasses.replace(CAPABILITIES, seccomp=False)
PWNED = f"/var/tmp/arl-pwned-{uuid.uuid4().hex}"  # /tmp is the working directory
SECRET_FILE = os.path.abspath(f"arl-test-secret-{uuid.uuid4().hex}.txt")  # in our cwd
# Generous: a loaded 2-core machine runs ~30 of these at once.
SLACK_S = 4.0


def _victim_pid() -> int:
    """A `sleep` that is not our child (so the parent-unaffected check ignores it) for
    the sandbox to try to kill."""
    out = subprocess.run(["sh", "-c", "sleep 120 >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def env():
    """A listening TCP server on 127.0.0.1 (nobody may connect) and a victim process."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    victim = _victim_pid()
    yield server, victim
    server.close()
    os.kill(victim, signal.SIGKILL)


def programs(port: int, victim: int) -> dict:
    """name -> (program, limits)."""
    return {
        "sum": ("print(sum(range(10**6)))", QUICK),
        "zero_division": ("def f():\n    return 1 / 0\nf()", QUICK),
        "zero_division_3_lines": ("def f():\n    return 1 / 0\nf()",
                                  dataclasses.replace(QUICK, traceback_lines=3)),
        "busy_loop": ("while True: pass", QUICK),
        "sleep_forever": ("import time\nprint('before', flush=True)\ntime.sleep(10**6)", SHORT),
        "fork_bomb": ("import os\nwhile True: os.fork()", QUICK),
        "string_bomb": ("x = 'a' * 10**10", BOMB),
        "list_bomb": ("x = []\nwhile True: x.append(' ' * 10**6)", BOMB),
        "huge_print": ("print('x' * 10**8)", BOMB),
        "print_loop": ("while True: print('spam')", BOMB),
        "read_passwd": ("print(open('/etc/passwd').read())", QUICK),
        "read_parent_cwd": (f"print(open({SECRET_FILE!r}).read())", QUICK),
        "write_tmp": (f"open({PWNED!r}, 'w').write('x')", QUICK),
        "write_parent_dir": ("open('../arl-pwned', 'w').write('x')", QUICK),
        "os_open_outside": ("import os\nos.open('/etc/hostname', os.O_RDONLY)", QUICK),
        "listdir_root": ("import os\nprint(os.listdir('/'))", QUICK),
        "socket": ("import socket", QUICK),
        "urllib": (f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}')",
                   QUICK),
        "environ": ("import os, json\nprint(json.dumps(dict(os.environ)))", QUICK),
        "kill_parent": ("import os\nos.kill(os.getppid(), 9)", QUICK),
        "kill_victim": (f"import os\nos.kill({victim}, 9)", QUICK),
        "ctypes": ("import ctypes", QUICK),
        "non_utf8": ("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe')\nprint('done')", QUICK),
        "exit_3": ("import sys\nsys.exit(3)", QUICK),
        "syntax_error": ("x = (1,\nprint(x)", QUICK),
        "work_files": ("import os\nos.mkdir('d')\nopen('d/a.txt', 'w').write('hello')\n"
                       "print(open('d/a.txt').read(), sorted(os.listdir('d')))", QUICK),
        "big_file": ("open('big', 'w').write('x' * (2 * 2**20))",
                     dataclasses.replace(QUICK, max_file_bytes=2**20)),
        "long_output": ("print('y' * 5000)", QUICK),
        "stdlib_imports": ("import collections, re, json, math, textwrap, dataclasses, typing\n"
                           "import json.tool, xml.etree.ElementTree, html.parser, encodings.idna\n"
                           "print(re.sub('a', 'b', 'banana'), math.comb(5, 2), "
                           "'é'.encode('utf-16-le'), 'bücher.de'.encode('idna'))", QUICK),
        "subprocess": ("import subprocess\nsubprocess.run(['true'])", QUICK),
        "os_system": ("import os\nos.system('touch /tmp/arl-pwned-system')", QUICK),
        "symlink_escape": ("import os\nos.symlink('/etc', 'etc')\nprint(open('etc/passwd').read())",
                           QUICK),
        "proc_self_fd_escape": ("print(open('/proc/self/fd/3/../../../../etc/passwd').read())",
                                QUICK),
        "hand_made_code": ("def f(): pass\nf.__code__.replace(co_code=b'\\x00' * 8)", QUICK),
        "hook_frame_tamper": (
            "import sys\n"
            "try:\n"
            "    open('/etc/passwd')\n"
            "except PermissionError as error:\n"
            "    tb = error.__traceback__\n"
            "    while tb.tb_next: tb = tb.tb_next\n"
            "    frame = tb.tb_frame\n"
            "    frame.f_globals['DENIED_EVENTS'] = frozenset()\n"
            "    frame.f_globals['__builtins__'] = {}\n"
            "    frame.f_locals['write_roots'] = ('/',)\n"
            f"open({PWNED!r}, 'w').write('x')", QUICK),
        "monkeypatch_os": ("import os, posixpath, builtins\n"
                           "posixpath.realpath = os.path.realpath = lambda p: '/tmp/x'\n"
                           "os.getcwd = lambda: '/'\nbuiltins.type = lambda x: str\n"
                           f"open({PWNED!r}, 'w').write('x')", QUICK),
        "pathlike_outside": ("import pathlib\npathlib.Path('/etc/passwd').read_text()", QUICK),
        "pwd": ("import pwd\nprint(pwd.getpwall())", QUICK),
        "unaudited_escapes": (
            "import os, signal, sys, _imp\n"
            "print(hasattr(os, 'pidfd_open'), hasattr(signal, 'pidfd_send_signal'),\n"
            "      hasattr(_imp, 'create_builtin'), hasattr(_imp, 'exec_builtin'))\n"
            f"blocked = {sorted(child.BLOCKED_MODULES)!r}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in blocked))\n", QUICK),
    }


def kernel_programs(port: int, victim: int) -> dict:
    """The kernel layers on their own (run with the audit hooks off; the `_no_seccomp`
    ones with the seccomp filter off as well, to show the layer beneath it)."""
    return {
        "kernel_fork_bomb": ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
                             dataclasses.replace(SHORT, wall_time_s=2.0, max_processes=8)),
        "kernel_fork": ("import os\nos.fork()", QUICK),
        "kernel_connect": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)",
                           QUICK),
        "kernel_connect_no_seccomp": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)", QUICK),
        "kernel_write_tmp": (f"open({PWNED!r}, 'w').write('x')", QUICK),
        "kernel_write_root": ("open('/x', 'w').write('x')", QUICK),
        "kernel_kill_victim": (f"import os\nos.kill({victim}, 9)", QUICK),
        "kernel_proc": ("import os\n"
                        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))",
                        QUICK),
        "kernel_uid": ("import os\nprint([os.getresuid(), os.getresgid()])", QUICK),
        "kernel_disk_fill": ("i = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * 2**20)\n"
                             "    i += 1", dataclasses.replace(QUICK, max_disk_bytes=4 * 2**20)),
    }


def _run_case(case):
    name, (code, limits) = case
    if name.endswith("_no_seccomp"):
        return sandbox.execute(code, limits, PYTHON, NO_SECCOMP, audit_hooks=False)
    if name.startswith("kernel_"):
        return sandbox.execute(code, limits, PYTHON, CAPABILITIES, audit_hooks=False)
    return run_python(code, limits=limits)


@pytest.fixture(scope="module")
def results(env):
    server, victim = env
    with open(SECRET_FILE, "w") as f:
        f.write("the parent's secret")
    port = server.getsockname()[1]
    cases = list(programs(port, victim).items()) + list(kernel_programs(port, victim).items())
    try:
        with ToolPool(16) as pool:
            outcome = pool.map(_run_case, cases)
    finally:
        os.remove(SECRET_FILE)
    return dict(zip([name for name, _ in cases], outcome))


def assert_error(result, last_line_start):
    assert result.status is Status.ERROR, result
    assert result.observation.splitlines()[-1].startswith(last_line_start), result.observation


def assert_refused(result, what):
    assert_error(result, "PermissionError: sandbox:")
    assert what in result.observation, result.observation


# ------------------------------------------------------------------------ correct runs


def test_correct_program_gives_the_exact_answer(results):
    result = results["sum"]
    assert result.status is Status.OK and result.ok
    assert result.observation == result.stdout == "499999500000\n"
    assert result.exit_code == 0 and not result.limit_exceeded


def test_files_in_the_working_directory_work(results):
    assert results["work_files"].observation == "hello ['a.txt']\n"


def test_standard_library_imports_work(results):
    # Codecs and submodules of packages imported before the privilege drop included.
    assert results["stdlib_imports"].observation == (
        "bbnbnb 10 b'\\xe9\\x00' b'xn--bcher-kva.de'\n")


def test_error_observation_is_the_traceback_tail(results):
    assert results["zero_division"].observation == "ZeroDivisionError: division by zero"
    assert results["zero_division"].exit_code == 1
    stderr = results["zero_division"].stderr
    assert stderr.startswith("Traceback (most recent call last):\n  File \"main.py\", line 3")
    assert "_sandbox_child" not in stderr and "<string>" not in stderr  # no bootstrap frames
    three = results["zero_division_3_lines"].observation.splitlines()
    assert three == ["    return 1 / 0", "           ~~^~~", "ZeroDivisionError: division by zero"]


def test_exit_status_and_syntax_error(results):
    assert results["exit_3"].status is Status.ERROR
    assert results["exit_3"].exit_code == 3
    assert results["exit_3"].observation == "exit status 3"
    assert_error(results["syntax_error"], "SyntaxError: '(' was never closed")


def test_non_utf8_output_is_replaced(results):
    result = results["non_utf8"]
    assert result.status is Status.OK
    assert result.stdout == "\ufffd\ufffddone\n"


def test_long_output_is_cut_with_a_marker(results):
    result = results["long_output"]
    assert result.status is Status.OK
    assert result.stdout == "y" * 5000 + "\n"
    assert len(result.observation) <= QUICK.max_observation_chars
    assert result.observation.endswith(results_lib.TRUNCATION_MARKER)
    assert result.observation.startswith("y" * 1000) and result.output_truncated


# ------------------------------------------------------------------------------ limits


def test_busy_loop_hits_the_cpu_limit(results):
    result = results["busy_loop"]
    assert result.status is Status.CPU_LIMIT and result.limit_exceeded, result
    assert result.observation == "cpu time limit exceeded (1 s)"
    assert result.exit_code == -signal.SIGXCPU
    assert result.wall_time_s < QUICK.wall_time_s


def test_sleeping_forever_times_out_with_its_output(results):
    result = results["sleep_forever"]
    assert result.status is Status.TIMEOUT and result.timed_out and result.limit_exceeded
    assert result.observation == "before\ntimeout after 1.0 s"
    assert 1.0 <= result.wall_time_s < 1.0 + SLACK_S


def test_timeout_is_prompt():
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(60)",
                        limits=dataclasses.replace(SHORT, wall_time_s=0.5))
    elapsed = time.monotonic() - start
    assert result.status is Status.TIMEOUT
    assert result.observation == "timeout after 0.5 s"
    assert 0.5 <= elapsed < 2.0


@pytest.mark.parametrize("name", ["string_bomb", "list_bomb"])
def test_memory_bombs_hit_the_memory_limit(results, name):
    result = results[name]
    assert result.status is Status.MEMORY_LIMIT, result
    assert result.observation == "memory limit exceeded (256 MiB)"


@pytest.mark.parametrize("name", ["huge_print", "print_loop"])
def test_huge_output_is_cut_and_the_program_killed(results, name):
    result = results[name]
    assert result.status is Status.OUTPUT_LIMIT, result
    assert len(result.stdout.encode()) <= QUICK.max_output_bytes
    assert len(result.observation) <= QUICK.max_observation_chars
    assert result.observation.endswith(
        f"{results_lib.TRUNCATION_MARKER}\noutput limit exceeded (more than 1048576 bytes)")
    assert result.wall_time_s < QUICK.wall_time_s


def test_file_size_limit(results):
    result = results["big_file"]
    assert result.status is Status.FILE_SIZE_LIMIT, result
    assert "File too large" in result.observation


def test_fork_bomb_is_refused(results):
    assert_refused(results["fork_bomb"], "os.fork is not allowed")


# ----------------------------------------------------------------- files and processes


def test_reading_outside_the_working_directory_is_refused(results):
    assert_refused(results["read_passwd"], "reading '/etc/passwd'")
    if SECRET_FILE.startswith("/tmp/"):
        # A checkout under /tmp: inside, that path names the program's own /tmp, which the
        # hooks allow and where the file does not exist.
        assert_error(results["read_parent_cwd"], "FileNotFoundError")
    else:
        assert_refused(results["read_parent_cwd"], f"reading '{SECRET_FILE}'")
    assert "secret" not in results["read_parent_cwd"].stdout
    assert_refused(results["os_open_outside"], "opening '/etc/hostname'")
    assert_refused(results["listdir_root"], "listing '/'")
    assert_refused(results["pathlike_outside"], "reading '/etc/passwd'")


def test_writing_outside_the_working_directory_is_refused(results, private_tempdir):
    assert_refused(results["write_tmp"], f"writing '{PWNED}'")
    assert_refused(results["write_parent_dir"], "writing '../arl-pwned'")
    assert not os.path.exists(PWNED)
    assert not os.path.exists(os.path.join(private_tempdir, "arl-pwned"))


def test_escapes_through_links_are_refused(results):
    assert_refused(results["symlink_escape"], "os.symlink is not allowed")
    assert_refused(results["proc_self_fd_escape"], "is not allowed")


def test_processes_and_signals_are_refused(results, env):
    assert_refused(results["kill_parent"], "os.kill is not allowed")
    assert_refused(results["kill_victim"], "os.kill is not allowed")
    assert _alive(env[1])
    assert_refused(results["subprocess"], "module 'subprocess' is not available")
    assert_refused(results["os_system"], "os.system is not allowed")
    assert not os.path.exists("/tmp/arl-pwned-system")


def test_network_and_native_code_are_refused(results, env):
    assert_refused(results["socket"], "module 'socket' is not available")
    assert_refused(results["urllib"], "module 'socket' is not available")
    with pytest.raises(BlockingIOError):
        env[0].accept()  # nobody connected
    assert_refused(results["ctypes"], "module 'ctypes' is not available")
    assert_refused(results["hand_made_code"], "code.__new__ is not allowed")


def test_unaudited_escapes_are_removed(results):
    # pidfds would signal any process of the same uid; _imp.create_builtin would load a
    # compiled-in module (e.g. _posixsubprocess in Debian's build) without an import event.
    assert results["unaudited_escapes"].observation == "False False False False\n[]\n"
    assert_refused(results["pwd"], "module 'pwd' is not available")


def test_environment_is_empty(results):
    result = results["environ"]
    assert result.status is Status.OK
    assert SECRET_NAME not in result.stdout and SECRET_VALUE not in result.stdout
    assert set(eval(result.stdout)) <= {"LC_CTYPE"}  # set by CPython's UTF-8 coercion


def test_hook_state_cannot_be_tampered_with(results):
    # The refusal's traceback hands the program the hook's frame; changing its globals
    # or locals snapshot, or monkeypatching os/posixpath/builtins, changes nothing.
    assert_refused(results["hook_frame_tamper"], f"writing '{PWNED}'")
    assert_refused(results["monkeypatch_os"], f"writing '{PWNED}'")
    assert not os.path.exists(PWNED)


def test_audit_hook_reads_no_global_or_builtin_name():
    hook = child.make_audit_hook(
        "/w", ("/lib",), ("/lib/lib-dynload",), (), lstat=os.lstat, readlink=os.readlink,
        getcwd=os.getcwd, permission_error=PermissionError, os_error=OSError, write_flags=3)
    loads = [i.argval for i in dis.get_instructions(hook)
             if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    assert loads == []
    immutable = (frozenset, tuple, str, int, type, type(os.lstat))
    assert all(isinstance(cell.cell_contents, immutable) for cell in hook.__closure__)


def test_audit_hook_rules_directly(tmp_path):
    workdir = str(tmp_path)
    hook = child.make_audit_hook(
        workdir, ("/usr/lib/python3",), ("/usr/lib/python3/lib-dynload",),
        ("/usr/lib/python3/site-packages",), lstat=os.lstat, readlink=os.readlink,
        getcwd=lambda: workdir, permission_error=PermissionError, os_error=OSError,
        write_flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT)
    allowed = [("open", ("a.txt", "w", 0)), ("open", (workdir + "/b", "r", 0)),
               ("open", ("/usr/lib/python3/json/__init__.py", "r", 0)),
               ("open", (3, "r", 0)), ("open", ("/dev/null", "w", 0)),
               ("import", ("json", None, [], [], [])),
               ("import", ("_json", "/usr/lib/python3/lib-dynload/_json.so", None, None, None)),
               ("os.remove", ("a.txt", -1)), ("os.rename", ("a", "b", -1, -1)),
               ("os.listdir", ("/usr/lib/python3",)), ("exec", (None,))]
    refused = [("open", ("/usr/lib/python3/json/__init__.py", "w", 0)),
               ("open", ("/usr/lib/python3/site-packages/x.py", "r", 0)),
               ("open", ("/usr/lib/python3/json", None, 0)),   # os.open outside workdir
               ("open", ("/usr/lib/python3/x", "r", os.O_RDWR)),  # write flag, read mode
               ("open", ("sub/../../x", "w", 0)),
               ("open", (b"/etc/passwd", "r", 0)),
               ("open", (type("P", (), {"__fspath__": lambda s: "a"})(), "r", 0)),
               ("import", ("ctypes.util", None, [], [], [])),
               ("import", ("evil", workdir + "/evil.so", None, None, None)),
               # a blocked extension's file under an innocent name: refused by the file
               ("import", ("alias.x", "/usr/lib/python3/lib-dynload/"
                           "_posixsubprocess.cpython-311-x86_64-linux-gnu.so", None, None, None)),
               ("import", ("alias._socket", "/usr/lib/python3/lib-dynload/x.so", None, None,
                           None)),  # PyInit__socket: refused by the name's last component
               ("os.remove", ("a.txt", 5)), ("os.rename", ("a", "/tmp/b", -1, -1)),
               ("os.chdir", ("/",)), ("socket.connect", (None, None)),
               ("ctypes.dlopen", ("libc.so.6",)), ("gc.get_referrers", ()),
               ("os.listdir", ("/etc",))]
    for event, args in allowed:
        hook(event, args)
    for event, args in refused:
        with pytest.raises(PermissionError, match="sandbox"):
            hook(event, args)


# --------------------------------------------------------------- kernel layers alone


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


@pytest.mark.skipif(not CAPABILITIES.seccomp, reason="no seccomp filter here")
def test_kernel_refuses_process_creation(results):
    assert_error(results["kernel_fork"], "PermissionError: [Errno 1] Operation not permitted")
    # The refused forks spin: the CPU limit (1 s) or the wall limit (2 s) ends the call,
    # whichever comes first with the cores this process gets.
    assert results["kernel_fork_bomb"].status in (Status.TIMEOUT, Status.CPU_LIMIT)


@pytest.mark.skipif(not CAPABILITIES.uid_drop,
                    reason="RLIMIT_NPROC bounds a fork bomb per uid only when run as root")
def test_kernel_bounds_a_fork_bomb_without_hooks_and_seccomp(monkeypatch, env):
    uid = 1_999_999_001
    monkeypatch.setattr(sandbox._uid_random, "randrange", lambda *_: uid)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _processes_of(uid))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        code, limits = kernel_programs(0, env[1])["kernel_fork_bomb"]
        result = sandbox.execute(code, limits, PYTHON, NO_SECCOMP, audit_hooks=False)
    finally:
        stop.set()
        watcher.join()
    assert result.status in (Status.TIMEOUT, Status.CPU_LIMIT), result
    assert 2 <= peak[0] <= 8, peak[0]  # it forked, and never past RLIMIT_NPROC = 8
    assert _processes_of(uid) == 0  # all killed with the PID namespace / process group


@pytest.mark.skipif(not CAPABILITIES.network_namespace, reason="no network namespace here")
def test_kernel_has_no_network(results, env):
    if CAPABILITIES.seccomp:  # no socket at all
        assert "PermissionError: [Errno 1] Operation not permitted" in results[
            "kernel_connect"].observation
    result = results["kernel_connect_no_seccomp"]  # the network namespace beneath it
    assert result.status is Status.ERROR
    assert "OSError: [Errno 101] Network is unreachable" in result.observation, result
    with pytest.raises(BlockingIOError):
        env[0].accept()


@pytest.mark.skipif(not CAPABILITIES.mount_namespace, reason="no minimal root here")
def test_kernel_keeps_writes_in_the_working_directory(results):
    # The minimal root has no /var/tmp, and its root is read-only.
    assert "[Errno 2] No such file or directory" in results["kernel_write_tmp"].observation
    assert "[Errno 30] Read-only file system" in results["kernel_write_root"].observation
    assert not os.path.exists(PWNED) and not os.path.exists("/x")
    fill = results["kernel_disk_fill"]
    assert fill.status is Status.FILE_SIZE_LIMIT, fill
    assert "No space left on device" in fill.observation


@pytest.mark.skipif(not CAPABILITIES.pid_namespace, reason="no PID namespace here")
def test_kernel_hides_and_protects_other_processes(results, env):
    assert results["kernel_kill_victim"].status is Status.ERROR
    assert "ProcessLookupError" in results["kernel_kill_victim"].observation
    assert _alive(env[1])
    if CAPABILITIES.mount_namespace:
        # Only the program itself: the supervisor (root, PID 1) is hidden (hidepid=2).
        assert eval(results["kernel_proc"].observation) == [2]


@pytest.mark.skipif(not CAPABILITIES.uid_drop, reason="only as root")
def test_kernel_runs_the_program_unprivileged(results):
    uids, gids = eval(results["kernel_uid"].observation)
    assert len(set(uids)) == 1 and len(set(gids)) == 1 and uids[0] >= 1_500_000_000


# ---------------------------------------------------------------------------- fallbacks


def _reachable_by_others(path: str) -> bool:
    """Whether another uid may execute `path`: every directory above it searchable."""
    parts = path.split("/")
    return all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o001 for i in range(1, len(parts)))


@pytest.mark.parametrize("capabilities", [
    sandbox.SandboxCapabilities(),
    sandbox.SandboxCapabilities(uid_drop=os.geteuid() == 0),
    pytest.param(
        sandbox.SandboxCapabilities(uid_drop=os.geteuid() == 0, seccomp=CAPABILITIES.seccomp),
        marks=pytest.mark.skipif(
            os.geteuid() == 0 and not _reachable_by_others(PYTHON),
            reason="the worker's interpreter, executed as an unprivileged uid without the "
                   "minimal root, must be reachable by other uids")),
], ids=["no_namespaces", "no_namespaces_uid_drop", "no_namespaces_seccomp"])
def test_fallback_without_namespaces(capabilities):
    run = lambda code, limits=QUICK: sandbox.execute(code, limits, PYTHON, capabilities, True)
    assert run("print(6 * 7)").observation == "42\n"
    assert_refused(run("open('/etc/passwd')"), "reading '/etc/passwd'")
    slept = run("import time\ntime.sleep(60)", dataclasses.replace(SHORT, wall_time_s=0.5))
    assert slept.status is Status.TIMEOUT and slept.wall_time_s < 2.5
    assert run("open('f', 'w').write('x')\nprint(open('f').read())").observation == "x\n"


# ------------------------------------------------------------------ helpers, arguments


def test_compose_observation_keeps_the_status_line():
    text, cut = results_lib.compose_observation("a" * 500, "timeout after 1.0 s", 100)
    assert len(text) <= 100 and cut
    assert text.endswith(f"{results_lib.TRUNCATION_MARKER}\ntimeout after 1.0 s")
    assert results_lib.compose_observation("out", "err", 100) == ("out\nerr", False)
    assert results_lib.compose_observation("out\n", "err", 100) == ("out\nerr", False)
    assert results_lib.compose_observation("abc", None, 100) == ("abc", False)
    text, cut = results_lib.truncate_text("z" * 300, 90)
    assert len(text) == 90 and text.endswith(results_lib.TRUNCATION_MARKER) and cut


def test_overlong_program_is_not_run():
    result = run_python("x = 1\n" * 10, limits=dataclasses.replace(QUICK, max_code_chars=50))
    assert result.status is Status.ERROR
    assert result.observation == "program longer than 50 characters; not run"


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")
    with pytest.raises(TypeError, match="limits must be a SandboxLimits"):
        run_python("print(1)", limits={"wall_time_s": 1})
    with pytest.raises(ValueError, match="SandboxLimits.wall_time_s"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="SandboxLimits.memory_bytes"):
        SandboxLimits(memory_bytes=2**20)
    with pytest.raises(ValueError, match="SandboxLimits.max_processes"):
        SandboxLimits(max_processes=1.5)
    with pytest.raises(ValueError, match="SandboxLimits.max_processes must be at least 2"):
        SandboxLimits(max_processes=1)
    with pytest.raises(ValueError, match="python must be the path"):
        run_python("print(1)", python="/nonexistent/python")


@pytest.mark.parametrize("stderr, status", [
    ("Traceback (most recent call last):\n  File \"<string>\", line 2\nMemoryError\n",
     Status.MEMORY_LIMIT),
    ("", Status.CPU_LIMIT),
    ("MemoryError\nbut it went on computing\n", Status.CPU_LIMIT),
])
def test_a_program_dying_of_memory_when_the_cpu_limit_strikes_reports_memory(stderr, status):
    """On a loaded host, faulting in 256 MiB can use the whole CPU allowance: the list bomb
    was seen killed by SIGXCPU while printing its MemoryError. The traceback as the last
    output means the memory limit came first."""
    collected = sandbox._Collected(  # pylint: disable=protected-access
        stdout=bytearray(), stderr=bytearray(stderr.encode()),
        status_line=f"signal {int(signal.SIGXCPU)} 1.02", output_exceeded=False,
        backstop_timeout=False)
    result = sandbox._result(collected, QUICK, None, 1.5)  # pylint: disable=protected-access
    assert result.status is status, result

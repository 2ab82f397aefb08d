"""The sandbox's supervisor (see `arl.tools.sandbox`).

It is executed as `python -I -S -B -u -X utf8 -c <source> <config json>` by
`arl.tools.sandbox.run_python`, where <source> is `arl.tools._sandbox_kernel`'s source
followed by this file's; never imported there (tests import it). The worker's source
(`arl.tools._sandbox_worker`) comes in the configuration. It uses the standard library
only:

* the *supervisor* (first process; PID 1 of a fresh PID namespace when one is available)
  reads the untrusted program, builds the minimal root and `pivot_root`s into it (with a
  mount namespace, through `ctypes`), forks its child, waits for it with the wall-time
  limit, kills it on expiry and reports how it ended as one line on the status pipe
  (``exit N CPU_SECONDS``, ``signal N CPU_SECONDS``, ``timeout`` or ``error MESSAGE``);
* its *child* closes the status pipe, sets the resource limits, drops to an unprivileged
  user id when the supervisor is root and, with a kernel layer, `execve`s the worker's
  fresh interpreter (under the seccomp filter, when there is one): the program's
  process never held `ctypes` (`arl.tools._sandbox_worker`). Without a kernel layer the
  child runs the worker itself.
"""

import json
import os
import sys

if __name__ != "__main__":  # imported (tests); run, this file's source follows the kernel's
    from arl.tools._sandbox_kernel import build_minimal_root, install_seccomp_and_exec


def _report(status_fd, line):
    try:
        os.write(status_fd, (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _wait(pid, timeout):
    """(wait status, CPU seconds) of the child, or None if it still runs after `timeout`."""
    import select
    import time
    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                return status, usage.ru_utime + usage.ru_stime
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if pidfd is not None:
                select.select([pidfd], [], [], remaining)
            else:
                time.sleep(min(remaining, 0.005))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _limit_and_drop(config):
    """In the supervisor's child: the resource limits, then the unprivileged uid."""
    import resource
    os.close(config["status_fd"])
    for name, (soft, hard) in config["rlimits"].items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
    uid = config["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError("dropping privileges failed")


def _start_worker(config):
    """In the supervisor's child; never returns. With a kernel layer (the minimal root
    or the seccomp filter): a fresh interpreter, `execve`d under the filter, runs the
    worker, so that nothing this process loaded (ctypes) is in the program's process.
    Without one, this process runs the worker itself (it never loaded ctypes)."""
    worker = config["worker"]
    if config["own_session"]:
        # Its own session and process group: a group signal (kill(0), killpg) reaches
        # the program alone, never the supervisor or `unshare` outside the namespace
        # (same uid in a user namespace). It still dies with the namespace's PID 1.
        os.setsid()
    if config["root"] is None and config["seccomp"] is None:
        functions = {"__name__": "arl_sandbox_worker"}
        exec(compile(config["worker_source"], "<worker>", "exec"), functions)
        library = None
        if config["uid"] is not None:
            # After the privilege drop the worker may not reach the interpreter's
            # directories (e.g. under a 0700 home): it imports through descriptors
            # opened now, as /proc/self/fd/N.
            library = [(p, os.path.realpath(p),
                        "/proc/self/fd/%d" % os.open(p, os.O_RDONLY | os.O_DIRECTORY))
                       for p in sys.path if os.path.isdir(p)]
            functions["_preload"](worker["preload"])
        _limit_and_drop(config)
        functions["run_program"](worker, library)
    argv = [config["python"], "-I", "-S", "-B", "-u", "-X", "utf8", "-c",
            config["worker_source"] + "\nworker_main()\n", json.dumps(worker)]
    if config["seccomp"] is not None:
        for name in ("ctypes", "fcntl", "struct"):  # the exec step's, while reachable
            __import__(name)
    _limit_and_drop(config)
    if config["seccomp"] is not None:
        install_seccomp_and_exec(bytes.fromhex(config["seccomp"]),
                                 config["seccomp_number"], argv)
    os.execve(argv[0], argv, {})


def _supervise(config):
    """Builds the program's world, forks the worker's process and reports how it ended;
    returns only in that child."""
    workdir = config["workdir"]
    with open(os.path.join(workdir, "main.py"), "rb") as f:
        source = f.read()
    uid = config["uid"]
    if config["root"] is not None:
        build_minimal_root(workdir, config["root"], config["work_options"],
                           config["pivot_root"])
        workdir = "/tmp"
        with open("main.py", "wb") as f:
            f.write(source)
    if uid is not None:
        if config["root"] is None:
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
        os.chown(os.path.join(workdir, "main.py"), uid, uid)
    config["worker"]["roots"] = [os.path.realpath(p) for p in sys.path if os.path.isdir(p)]
    pid = os.fork()
    if pid == 0:
        return
    ended = _wait(pid, config["wall_time_s"])
    if ended is None:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
        os.waitpid(pid, 0)
        _report(config["status_fd"], "timeout")
        os._exit(0)
    status, cpu_seconds = ended
    if os.WIFSIGNALED(status):
        _report(config["status_fd"], "signal %d %.3f" % (os.WTERMSIG(status), cpu_seconds))
    else:
        _report(config["status_fd"], "exit %d %.3f" % (os.waitstatus_to_exitcode(status),
                                                      cpu_seconds))
    os._exit(0)


def main():
    import signal
    # PID 1 of a PID namespace gets, from inside it, only the signals it handles: with
    # Python's SIGINT handler gone, the program cannot interrupt its supervisor.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    config = json.loads(sys.argv[1])
    try:
        _supervise(config)
    except BaseException as exc:  # report the setup failure, never a traceback
        _report(config["status_fd"], "error %s: %s" % (type(exc).__name__, exc))
        os._exit(0)
    try:  # the child
        _start_worker(config)
    except BaseException as exc:
        if isinstance(exc, SystemExit):  # the program's own exit, run in this process
            raise
        sys.stderr.write("sandbox setup failed: %s: %s\n" % (type(exc).__name__, exc))
        os._exit(125)


if __name__ == "__main__":
    main()

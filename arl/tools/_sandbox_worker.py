"""The sandbox's worker: the process that runs the untrusted program (see
`arl.tools.sandbox`). Standard library only; never imported in the sandbox (tests import
it to inspect the audit hook).

The supervisor's child (`arl.tools._sandbox_child`) sets the resource limits, drops to an
unprivileged user id and, with the seccomp filter or the minimal root, executes a fresh
interpreter, ``python -I -S -B -u -X utf8 -c <this file's source>worker_main()
<config json>``: so no module the supervisor needed (``ctypes`` above all, whose types
would stay reachable through ``object.__subclasses__()`` with no audit event) is loaded
in the program's process. Without either (no kernel layer to set up), the child calls
`run_program` directly. `run_program` imports a few common modules (from cached
bytecode; any other module is compiled from source), takes away the calls that would
bypass the audit hook without an event, installs the hook and executes the program as
``__main__``. Its traceback is printed without the bootstrap's own frames.

The audit hook (`make_audit_hook`) keeps all its state in immutable closure values
(frozensets, tuples, strings, builtin functions) and reads no global or builtin name, so
a program that monkeypatches ``os``, ``posixpath`` or ``builtins``, or that reaches the
hook's frame through a traceback, cannot change what it allows.
"""

import os
import sys

# Imports the worker refuses (the module or any submodule), with why:
BLOCKED_MODULES = frozenset({
    "ctypes", "_ctypes", "_ctypes_test",               # native calls bypass every hook
    "socket", "_socket", "ssl", "_ssl",                # network
    "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing",  # processes
    "_posixshmem",                                     # shm_open writes /dev/shm in C
    "sqlite3", "_sqlite3", "_dbm", "_gdbm",            # open files in C, unaudited
    "readline", "syslog", "_curses", "_curses_panel", "_tkinter",
    "pwd", "grp", "spwd", "nis",                       # read /etc/passwd etc. in C
    "_xxsubinterpreters", "_xxinterpchannels", "_xxinterpqueues", "_interpreters",
    "_interpchannels", "_interpqueues",
    "_testcapi", "_testinternalcapi", "_testbuffer", "_testimportmultiple",
    "_testmultiphase", "_testsinglephase", "_testclinic", "_xxtestfuzz",
})

# Audit events the worker refuses outright.
DENIED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen", "pty.spawn",
    "os.chdir", "os.link", "os.symlink", "os.chroot",
    "sys.settrace", "sys.setprofile",                  # would hand out the hook's frame
    "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "code.__new__", "marshal.loads", "marshal.load",   # hand-made bytecode
    "resource.setrlimit", "resource.prlimit",
    "fcntl.flock", "fcntl.lockf",                      # locks on shared inodes
    "webbrowser.open", "sqlite3.connect", "sqlite3.enable_load_extension",
    "sqlite3.load_extension",
})
DENIED_EVENT_PREFIXES = ("socket.", "ctypes.", "sys.monitoring", "_winapi.", "winreg.",
                         "msvcrt.")

# Events whose path arguments must lie in the working directory: event -> indices of the
# path arguments, indices of dir_fd arguments (refused unless None or -1, which is how
# the os module reports "no dir_fd"). Argument layouts from the CPython audit events table.
WRITE_PATH_EVENTS = {
    "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
    "os.rename": ((0, 1), (2, 3)), "os.truncate": ((0,), ()), "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)), "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()), "os.chflags": ((0,), ()), "os.lchflags": ((0,), ()),
    "shutil.rmtree": ((0,), (1,)),
}
# Events whose path argument may also lie in the read-only roots (the standard library).
READ_PATH_EVENTS = {
    "os.listdir": 0, "os.scandir": 0, "os.getxattr": 0, "os.listxattr": 0,
}


def make_audit_hook(workdir, read_roots, dynload_roots, denied_subtrees, *,
                    lstat, readlink, getcwd, permission_error, os_error, write_flags,
                    blocked_modules=BLOCKED_MODULES, denied_events=DENIED_EVENTS,
                    denied_prefixes=DENIED_EVENT_PREFIXES,
                    write_path_events=None, read_path_events=None):
    """Returns the worker's audit hook (PEP 578).

    Paths (str or bytes; an int is a file descriptor, which the process can only have
    obtained through an audited open) are resolved like `os.path.realpath`, following
    symbolic links with `lstat`/`readlink`, and must lie in:
      * writing (any open with a write mode or flag, and the `WRITE_PATH_EVENTS`):
        `workdir` or /dev/null;
      * reading with `open`: additionally the `read_roots` (the standard library, minus
        `denied_subtrees` such as site-packages);
      * `os.open` (an open event with mode None), which may produce directory fds for
        dir_fd-relative calls the event does not show: `workdir` only. With `os.chdir`
        and `os.symlink` refused, the working directory stays `workdir` and holds no
        symbolic link, so a relative path that resolves inside it from there resolves
        inside it from any directory fd within it.
    Any other path type (e.g. a `pathlib.Path` passed to `os.mkdir`) is refused: calling
    its `__fspath__` here would run the program's code and could answer differently
    from the call the kernel sees.

    Imports of `blocked_modules` (by the module's name, and for an extension by the file
    loaded: its resolved file name, so `_posixsubprocess.cpython-311-....so` loaded under
    another name is refused too) and loading a native extension from outside the
    `dynload_roots` are refused, as are `denied_events` and events starting with
    `denied_prefixes`. Refusals raise `PermissionError("sandbox: ...")`.
    """
    get_type = type
    str_type, bytes_type, int_type = type(""), type(b""), type(0)
    if write_path_events is None:
        write_path_events = tuple(
            (name, paths, dir_fds) for name, (paths, dir_fds) in WRITE_PATH_EVENTS.items())
    if read_path_events is None:
        read_path_events = tuple(READ_PATH_EVENTS.items())
    write_events = frozenset(name for name, _, _ in write_path_events)
    read_events = frozenset(name for name, _ in read_path_events)
    write_roots = (workdir, "/dev/null")
    open_read_roots = write_roots + tuple(read_roots)
    dynload_roots = tuple(dynload_roots)
    denied_subtrees = tuple(denied_subtrees)

    # One flat function: a refusal's traceback hands the program this frame, whose locals
    # must therefore hold only immutable values (no inner function whose closure it could
    # rewrite).
    def hook(event, args):
        if get_type(event) is not str_type:
            return  # only sys.audit called by the program itself passes a str subclass
        if event in denied_events or event.startswith(denied_prefixes):
            raise permission_error("sandbox: " + event + " is not allowed")
        checks = []  # (path, allowed roots, what is being done)
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            if mode is None:  # os.open
                checks.append((path, write_roots, "opening"))
            elif get_type(mode) is not str_type or get_type(flags) is not int_type:
                raise permission_error("sandbox: open with an unusual mode is not allowed")
            elif ("w" in mode or "a" in mode or "x" in mode or "+" in mode
                    or (flags & write_flags) != 0):
                checks.append((path, write_roots, "writing"))
            else:
                checks.append((path, open_read_roots, "reading"))
        elif event == "import":
            name, filename = args[0], args[1]
            if get_type(name) is not str_type:
                raise permission_error("sandbox: import of a non-str name is not allowed")
            # By the name asked for, its first component, its last one (an extension's
            # PyInit_ function is named after it), and below by the file loaded.
            if (name in blocked_modules or name.split(".")[0] in blocked_modules
                    or name.split(".")[-1] in blocked_modules):
                raise permission_error("sandbox: module '" + name + "' is not available")
            if filename is not None:
                checks.append((filename, dynload_roots, "loading native code from"))
        elif event in write_events:
            for name, paths, dir_fds in write_path_events:
                if event == name:
                    for index in dir_fds:
                        if args[index] is not None and args[index] != -1:  # -1: none
                            raise permission_error(
                                "sandbox: " + event + " with dir_fd is not allowed")
                    for index in paths:
                        checks.append((args[index], write_roots, "changing"))
        elif event in read_events:
            for name, index in read_path_events:
                if event == name and args[index] is not None:
                    checks.append((args[index], open_read_roots, "listing"))
        for path, roots, what in checks:
            kind = get_type(path)
            if kind is int_type:
                continue  # a descriptor, obtained through an audited open
            if kind is bytes_type:
                path = path.decode("utf-8", "surrogateescape")
            elif kind is not str_type:
                raise permission_error("sandbox: " + event + " needs a str or bytes path, "
                                       "not " + kind.__name__)
            # realpath: resolve symbolic links (incl. /proc/self/fd/N) component by component
            full = path if path[:1] == "/" else getcwd() + "/" + path
            pending = full.split("/")[::-1]
            resolved = []
            links = 0
            while pending:
                part = pending.pop()
                if part == "" or part == ".":
                    continue
                if part == "..":
                    if resolved:
                        resolved.pop()
                    continue
                candidate = "/" + "/".join(resolved + [part])
                try:
                    is_link = (lstat(candidate).st_mode & 0o170000) == 0o120000
                except os_error:
                    is_link = False
                if is_link:
                    links += 1
                    if links > 40:
                        raise permission_error("sandbox: too many symbolic links")
                    target = readlink(candidate)
                    if target[:1] == "/":
                        resolved = []
                    pending.extend(target.split("/")[::-1])
                    continue
                resolved.append(part)
            real = "/" + "/".join(resolved)
            allowed = False
            for root in roots:
                if real == root or real.startswith(root + "/"):
                    allowed = True
            for subtree in denied_subtrees:
                if real == subtree or real.startswith(subtree + "/"):
                    allowed = False
            if not allowed:
                raise permission_error("sandbox: " + what + " '" + path + "' is not allowed")
            if event == "import" and real.split("/")[-1].split(".")[0] in blocked_modules:
                raise permission_error("sandbox: module file '" + path + "' is not available")

    return hook


def _import_through_descriptors(library):
    """Points `sys.path` and the `__path__` of every imported package (e.g. `encodings`,
    whose codecs load on first use) at the supervisor's /proc/self/fd/N descriptors."""
    def rebase(path):
        for original, real, through_fd in library:
            for prefix in (original, real):
                if path == prefix or path.startswith(prefix + "/"):
                    return through_fd + path[len(prefix):]
        return path

    sys.path[:] = [through_fd for _, _, through_fd in library]
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if type(search) is list:
            search[:] = [rebase(p) for p in search]


def _remove_unaudited_escapes():
    """Takes away what would bypass the audit hook without raising an event: pidfds
    (`os.pidfd_open` + `signal.pidfd_send_signal` signal any process the uid may signal)
    and `_imp.create_builtin`/`exec_builtin`, which make a fresh copy of a compiled-in
    module (e.g. `_posixsubprocess` or `_socket` in some builds, or `posix` with its
    pidfd_open) without an import event. The other compiled-in modules are imported
    first, so that importing them later does not need `_imp`."""
    import _imp
    import _signal
    import posix
    for name in sys.builtin_module_names:
        if name not in sys.modules and name not in BLOCKED_MODULES:
            try:
                __import__(name)
            except ImportError:
                pass
    removals = [(posix, "pidfd_open"), (os, "pidfd_open"), (_signal, "pidfd_send_signal"),
                (_imp, "create_builtin"), (_imp, "exec_builtin")]
    if "signal" in sys.modules:
        removals.append((sys.modules["signal"], "pidfd_send_signal"))
    for module, name in removals:
        if hasattr(module, name):
            delattr(module, name)


def _preload(names):
    for name in names:
        try:
            __import__(name)
        except ImportError:
            pass


def _prepare(config, library):
    """(compiled program, its `__main__` module): everything but the audit hook."""
    import builtins
    _preload(config["preload"])
    if library is not None:
        _import_through_descriptors(library)
    sys.pycache_prefix = "/nonexistent/arl-sandbox-pycache"  # compile the library from source
    with open("main.py", "rb") as f:
        source = f.read()
    code = compile(source, "main.py", "exec", dont_inherit=True)
    if config["audit"]:
        _remove_unaudited_escapes()
    main = type(sys)("__main__")
    main.__dict__.update(__builtins__=builtins, __file__="main.py")
    sys.modules["__main__"] = main
    if config["audit"]:
        roots = config["roots"]
        dynload = [root for root in roots if root.endswith("lib-dynload")]
        denied = [root + "/" + sub for root in roots
                  for sub in ("site-packages", "dist-packages")]
        write_flags = (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC)
        sys.addaudithook(make_audit_hook(
            os.path.realpath(os.getcwd()), tuple(roots), tuple(dynload), tuple(denied),
            lstat=os.lstat, readlink=os.readlink, getcwd=os.getcwd,
            permission_error=PermissionError, os_error=OSError, write_flags=write_flags))
    return code, main


def run_program(config, library=None):
    """Runs ./main.py as ``__main__`` (module docstring); never returns. `config`: the
    worker's part of the sandbox's configuration ("roots": the standard library's
    directories, "audit", "preload"); `library`: (original, real, /proc/self/fd/N)
    triples when the standard library must be reached through the supervisor's
    descriptors (an unprivileged uid without the minimal root)."""
    try:
        code, module = _prepare(config, library)
    except SyntaxError as exc:
        sys.excepthook(type(exc), exc, None)
        raise SystemExit(1)
    except BaseException as exc:
        sys.stderr.write("sandbox setup failed: %s: %s\n" % (type(exc).__name__, exc))
        os._exit(125)
    del config, library
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        traceback = exc.__traceback__
        if traceback is not None:  # hide this bootstrap frame
            exc.__traceback__ = traceback = traceback.tb_next
        sys.excepthook(type(exc), exc, traceback)
        raise SystemExit(1)
    raise SystemExit(0)


def worker_main():
    """The executed worker's entry point: its configuration is the first argument."""
    import json
    run_program(json.loads(sys.argv[1]))

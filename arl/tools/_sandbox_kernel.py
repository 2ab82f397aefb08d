"""The system calls the sandbox's supervisor and worker make through `ctypes` (standard
library only: this file's source runs inside the sandbox, prepended to
`arl.tools._sandbox_child`'s; see `arl.tools.sandbox`).

* `build_minimal_root` (supervisor, in its private mount namespace): builds the root
  described by an `arl.tools.rootfs.RootPlan` on a fresh tmpfs at `new_root`, mounts the
  private /proc and the size-limited working tmpfs at /tmp, makes the root read-only and
  `pivot_root`s into it, detaching the machine's file systems.
* `install_seccomp` (worker, right before the program runs): no new privileges, then the
  classic-BPF filter from `arl.tools.seccomp`.
"""

import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
_LOCKED = MS_NOSUID | MS_NODEV | MS_NOEXEC


def _libc():
    """(the ctypes module, this process's C library with the signatures used here)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_char_p)
    libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
    libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong)
    return ctypes, libc


def _check(result, what, path):
    if result != 0:
        import ctypes
        number = ctypes.get_errno()
        raise OSError(number, "%s %s: %s" % (what, path, os.strerror(number)))


def _mount(libc, source, target, fstype, flags, data=None):
    encode = lambda s: None if s is None else s.encode("utf-8", "surrogateescape")
    _check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)),
           "mount", target)


def _make_target(path, is_directory):
    os.makedirs(path if is_directory else os.path.dirname(path), mode=0o755, exist_ok=True)
    if not is_directory and not os.path.exists(path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def _bind(libc, source, target, writable=False, device=False):
    """A read-only (unless `writable`) bind mount; the interpreter, the libraries and the
    extension modules stay executable, only a device node keeps its device."""
    _make_target(target, os.path.isdir(source))
    _mount(libc, source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (MS_NOEXEC if device else MS_NODEV)
    _mount(libc, None, target, None, flags | (0 if writable else MS_RDONLY))


def build_minimal_root(new_root, plan, work_options, pivot_root_number):
    """Builds the root (module docstring) at `new_root` (an existing empty directory) and
    enters it; the working directory is then /tmp."""
    _, libc = _libc()
    os.umask(0o022)
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "arl-sandbox", new_root, "tmpfs", _LOCKED, "size=256k,nr_inodes=4096,mode=0755")
    for source, target, _ in plan["binds"]:
        _bind(libc, source, new_root + target)
    for path, writable in plan["devices"]:
        _bind(libc, path, new_root + path, writable=writable, device=True)
    for path in plan["masks"]:
        _mount(libc, "arl-sandbox", new_root + path, "tmpfs", _LOCKED | MS_RDONLY,
               "size=4k,nr_inodes=1,mode=0755")
    os.mkdir(new_root + "/proc", 0o555)
    for options in ("hidepid=2,subset=pid", "hidepid=2", None):
        try:
            _mount(libc, "proc", new_root + "/proc", "proc", _LOCKED, options)
            break
        except OSError:
            if options is None:
                raise
    os.mkdir(new_root + "/tmp", 0o700)
    _mount(libc, "arl-sandbox", new_root + "/tmp", "tmpfs", _LOCKED, work_options)
    _mount(libc, None, new_root, None, MS_REMOUNT | MS_RDONLY | _LOCKED)
    os.chdir(new_root)
    _check(libc.syscall(pivot_root_number, b".", b"."), "pivot_root", new_root)
    _check(libc.umount2(b".", MNT_DETACH), "umount", "the old root")
    os.chdir("/tmp")


def install_seccomp(kernel, program):
    """No new privileges, then the filter `program` (bytes of a `struct sock_filter[]`);
    `kernel` is `_libc()`'s (ctypes, libc), loaded before the privilege drop."""
    ctypes, libc = kernel

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    instructions = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(instructions))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0), "prctl", "NO_NEW_PRIVS")
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
           "prctl", "SECCOMP")

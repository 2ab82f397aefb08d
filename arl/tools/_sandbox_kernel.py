"""The system calls the sandbox's supervisor and worker make through `ctypes` (standard
library only: this file's source runs inside the sandbox, prepended to
`arl.tools._sandbox_child`'s; see `arl.tools.sandbox`).

* `build_minimal_root` (supervisor, in its private mount namespace): builds the root
  described by an `arl.tools.rootfs.RootPlan` on a fresh tmpfs at `new_root`, mounts the
  private /proc and the size-limited working tmpfs at /tmp, makes the root read-only and
  `pivot_root`s into it, detaching the machine's file systems.
* `install_seccomp_and_exec` (the supervisor's child, after the privilege drop): no new
  privileges, the filter from `arl.tools.seccomp`, then `execve` of the worker's fresh
  interpreter, the one `execve` the filter lets through. The worker thus starts filtered
  and without `ctypes`.
"""

import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER = 1, 8
SECCOMP_NOTIF_SIZE = 80  # struct seccomp_notif: id, pid, flags, struct seccomp_data
SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100  # _IOWR('!', 0, struct seccomp_notif)
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101  # _IOWR('!', 1, struct seccomp_notif_resp)
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
_LOCKED = MS_NOSUID | MS_NODEV | MS_NOEXEC


def _libc():
    """This process's C library with the mount signatures set."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_char_p)
    libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
    return libc


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


def _bind(libc, source, target, device=False):
    """A read-only bind mount; the interpreter, the libraries and the extension modules
    stay executable, only a device node keeps its device. Read-only makes the host's
    inode unchangeable (times, mode: EROFS); a device still reads and writes."""
    _make_target(target, os.path.isdir(source))
    _mount(libc, source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_RDONLY | (MS_NOEXEC if device else MS_NODEV)
    _mount(libc, None, target, None, flags)


def build_minimal_root(new_root, plan, work_options, pivot_root_number):
    """Builds the root (module docstring) at `new_root` (an existing empty directory) and
    enters it; the working directory is then /tmp."""
    libc = _libc()
    os.umask(0o022)
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "arl-sandbox", new_root, "tmpfs", _LOCKED, "size=256k,nr_inodes=4096,mode=0755")
    for source, target, _ in plan["binds"]:
        _bind(libc, source, new_root + target)
    for path in plan["devices"]:
        _bind(libc, path, new_root + path, device=True)
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


def install_seccomp_and_exec(program, seccomp_number, argv):
    """Executes `argv` (a fresh interpreter) under the seccomp filter `program` (bytes of
    a `struct sock_filter[]`, `arl.tools.seccomp`), which sends `execve` to a listener:
    a thread of this process answers that one notification, this `execve`'s, and the
    listener closes with it (close-on-exec), so that any later `execve` fails. Never
    returns; raises OSError if a step fails."""
    import _thread
    import ctypes
    import fcntl
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong)
    libc.syscall.restype = ctypes.c_long
    listener = []
    ready = _thread.allocate_lock()
    ready.acquire()

    def answer_the_exec():
        ready.acquire()
        while True:
            notification = bytearray(SECCOMP_NOTIF_SIZE)  # struct seccomp_notif, zeroed
            try:
                fcntl.ioctl(listener[0], SECCOMP_IOCTL_NOTIF_RECV, notification)
                break
            except InterruptedError:
                continue
        request_id = struct.unpack_from("=Q", notification)[0]
        response = bytearray(struct.pack("=QqiI", request_id, 0, 0,
                                         SECCOMP_USER_NOTIF_FLAG_CONTINUE))
        fcntl.ioctl(listener[0], SECCOMP_IOCTL_NOTIF_SEND, response)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    instructions = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(instructions))
    _thread.start_new_thread(answer_the_exec, ())
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl", "NO_NEW_PRIVS")
    fd = libc.syscall(seccomp_number, SECCOMP_SET_MODE_FILTER,
                      SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.byref(fprog))
    _check(0 if fd >= 0 else -1, "seccomp", "SET_MODE_FILTER")
    listener.append(fd)
    ready.release()
    encoded = [a.encode("utf-8", "surrogateescape") for a in argv]
    arguments = (ctypes.c_char_p * (len(encoded) + 1))(*encoded, None)
    environment = (ctypes.c_char_p * 1)(None)
    libc.execve(encoded[0], arguments, environment)  # releases the GIL for the thread
    _check(-1, "execve", argv[0])

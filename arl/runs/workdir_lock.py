"""One run per workdir: an exclusive `flock` on ``workdir/run.lock`` while it trains.

    with workdir_lock.hold(workdir):      # WorkdirInUseError if another run holds it
        ...

The kernel drops the lock when the holding process ends, however it ends (SIGKILL
included), so the file left behind never blocks a restart; it names the last holder
(process id, host, start time) for the error a second run gets. Under several
processes (`jax.distributed`) process 0 holds it for the run: the others write only
their checkpoint shards, which orbax coordinates. A filesystem without locks (some
network mounts) refuses `flock` with an OSError other than "would block": the run then
goes on without the lock, with a warning.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import socket
from typing import Iterator

from absl import logging
import jax

LOCK_FILE = "run.lock"


class WorkdirInUseError(RuntimeError):
    """Another process is training in the workdir (one line, naming it)."""


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
    """Holds the workdir's lock for the block (process 0 only); raises
    `WorkdirInUseError` at once when another process holds it."""
    if jax.process_index() != 0:
        yield
        return
    path = os.path.join(workdir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                logging.warning("Could not lock %s (%s): nothing stops a second run from "
                                "writing to this workdir.", path, error)
            else:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
                raise WorkdirInUseError(
                    f"workdir {workdir!r} is in use by another run ({holder or 'unknown'})"
                    f"; wait for it to end or use another workdir") from None
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()} since {started} "
                      "UTC\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock

"""One run per workdir: an exclusive `flock` on ``workdir/run.lock`` while it trains.

    with workdir_lock.hold(workdir):      # WorkdirInUseError if another run holds it
        ...

The kernel drops the lock when the holding process ends, however it ends (SIGKILL
included), so the file left behind never blocks a restart; it names the last holder
(process id, host, start time) for the error a second run gets. Under several
processes (`jax.distributed`) process 0 holds it for the run (the others write only
their checkpoint shards, which orbax coordinates) and tells the others whether to refuse. A filesystem without locks (some
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
from jax.experimental import multihost_utils
import numpy as np

LOCK_FILE = "run.lock"


class WorkdirInUseError(RuntimeError):
    """Another process is training in the workdir (one line, naming it)."""


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
    """Holds the workdir's lock for the block (process 0); raises `WorkdirInUseError`
    at once, on every process, when another run holds it."""
    fd, refusal = None, None
    if jax.process_index() == 0:
        fd, refusal = _lock(workdir)
    if jax.process_count() > 1:  # every process refuses, or none
        refused = multihost_utils.broadcast_one_to_all(np.int32(refusal is not None))
        if refused and refusal is None:
            refusal = (f"workdir {workdir!r} is in use by another run (process 0 found "
                       f"{LOCK_FILE} locked); wait for it to end or use another workdir")
    try:
        if refusal is not None:
            raise WorkdirInUseError(refusal)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _lock(workdir: str) -> tuple[int | None, str | None]:
    """(descriptor holding the lock, None), or (None, the refusal) when another process
    holds it; (None, None) on a filesystem without locks."""
    path = os.path.join(workdir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        os.close(fd)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            logging.warning("Could not lock %s (%s): nothing stops a second run from "
                            "writing to this workdir.", path, error)
            return None, None
        return None, (f"workdir {workdir!r} is in use by another run "
                      f"({holder or 'unknown'}); wait for it to end or use another workdir")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()} since {started} "
                  "UTC\n".encode(), 0)
    return fd, None

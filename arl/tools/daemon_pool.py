"""A thread pool whose abandoned calls never keep the process alive.

    pool = DaemonPool(max_workers=8, name="arl-reward")
    future = pool.submit(fn, *args, **kwargs)        # a concurrent.futures.Future
    concurrent.futures.wait([future], timeout=5.0)   # a call past its limit is abandoned
    pool.shutdown(wait=False, cancel_futures=True)

Why not `concurrent.futures.ThreadPoolExecutor`: its workers are joined when the
interpreter exits, so one user function that never returns (a reward function or a host
environment's turn stuck in a loop or on a socket) keeps the process alive after the run
has printed its error line and returned, forever if it never returns. A Python thread
cannot be killed; this pool's workers are daemon threads, which the interpreter stops
at exit, so an abandoned call ends with the process. Calls still queue when every worker
is busy (an abandoned call keeps its worker), as with `ThreadPoolExecutor`.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

_STOP = object()


class DaemonPool:
    """`submit` / `shutdown` of `ThreadPoolExecutor`, on daemon worker threads started
    on demand (at most `max_workers`)."""

    def __init__(self, max_workers: int, name: str = "arl-worker"):
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self.max_workers = max_workers
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("DaemonPool.submit called after shutdown()")
            self._queue.put((future, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._name}-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # pylint: disable=broad-except
                    future.set_exception(error)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops taking calls; `cancel_futures` cancels the queued ones; `wait` joins the
        workers (a call that never returns would block it: pass wait=False)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(_STOP)
        if wait:
            for thread in threads:
                thread.join()

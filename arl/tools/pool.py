"""Run a batch of tool calls (one per rollout row) in parallel, results in row order.

Each call (`arl.tools.sandbox.run_python`, `arl.tools.sql.run_sql`, or any function of
one item returning an `ExecutionResult`) already enforces its own time limit: the Python
sandbox runs in a subprocess, SQLite releases the GIL. So a thread pool is enough to
overlap them: `ToolPool(max_workers).map(fn, items)` submits every item at once and
waits for all, so a batch takes about as long as its slowest call (plus queueing when
there are more items than workers), not the sum.

`timeout_s` is a backstop for functions that do not bound themselves: a call still
running `timeout_s` seconds after it started is reported as a TIMEOUT result and
abandoned (a Python thread cannot be killed; its worker stays busy until the function
returns, so keep such functions rare; the workers are daemon threads, so it never keeps
the process alive at exit: `arl.tools.daemon_pool`). An exception raised by `fn` becomes an
INTERNAL_ERROR result, never an exception of `map`: the batch always comes back whole.

Used from a JAX host callback (`jax.experimental.io_callback`), `map` blocks the
callback's thread while the calls run; the pool must not be closed while a step using it
is in flight.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Callable, Sequence, TypeVar

from arl.tools.daemon_pool import DaemonPool
from arl.tools.results import (ExecutionResult, Status, format_seconds,
                               internal_error_result)

Item = TypeVar("Item")

_POLL_S = 0.05  # how often to look for calls that started, with a backstop timeout


def default_max_workers() -> int:
    """Four per CPU, at most 32: a sandboxed call spends much of its time waiting on the
    kernel (namespaces, mounts, process exit), so more calls than cores overlap well
    (measured on 2 cores: 64 trivial calls ran at 8/16/31/40/46 calls/s with 1/2/4/8/16
    workers)."""
    return min(32, 4 * (os.cpu_count() or 1))


class ToolPool:
    """A reusable thread pool for batches of tool calls; `close()` or use as a context
    manager. `map` may be called from several threads; calls share the workers."""

    def __init__(self, max_workers: int | None = None):
        if max_workers is None:
            max_workers = default_max_workers()
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self.max_workers = max_workers
        # Daemon workers: an abandoned call never keeps the process alive at exit.
        self._executor = DaemonPool(max_workers, name="arl-tool")
        self._closed = False
        self._lock = threading.Lock()

    def map(self, fn: Callable[[Item], ExecutionResult], items: Sequence[Item], *,
            timeout_s: float | None = None) -> list[ExecutionResult]:
        """`[fn(item) for item in items]`, computed in parallel (module docstring)."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(
                timeout_s, (int, float)) or not 0 < timeout_s < float("inf")):
            raise ValueError(f"timeout_s must be None or a finite number > 0, got {timeout_s!r}")
        items = list(items)
        started: list[float | None] = [None] * len(items)

        def call(index: int) -> ExecutionResult:
            started[index] = time.monotonic()
            try:
                return fn(items[index])
            except Exception as exc:  # the batch must come back whole
                return internal_error_result(f"tool call failed: {type(exc).__name__}: {exc}",
                                             time.monotonic() - started[index])

        with self._lock:
            if self._closed:
                raise RuntimeError("ToolPool.map called after close()")
            futures = [self._executor.submit(call, i) for i in range(len(items))]
        if timeout_s is None:
            return [future.result() for future in futures]
        return self._gather_with_backstop(futures, started, timeout_s)

    @staticmethod
    def _gather_with_backstop(futures, started, timeout_s) -> list[ExecutionResult]:
        results: list[ExecutionResult | None] = [None] * len(futures)
        pending = {future: index for index, future in enumerate(futures)}
        while pending:
            now = time.monotonic()
            for future, index in list(pending.items()):
                if future.done():
                    results[index] = future.result()
                    del pending[future]
                elif started[index] is not None and now - started[index] >= timeout_s:
                    results[index] = ExecutionResult(
                        observation=f"timeout after {format_seconds(timeout_s)} s",
                        status=Status.TIMEOUT, wall_time_s=now - started[index])
                    del pending[future]  # abandoned: its thread finishes on its own
            if not pending:
                break
            deadlines = [started[i] + timeout_s for i in pending.values()
                         if started[i] is not None]
            waiting_to_start = len(deadlines) < len(pending)
            wait = min(deadlines) - now if deadlines else _POLL_S
            if waiting_to_start:
                wait = min(wait, _POLL_S)
            concurrent.futures.wait(list(pending), timeout=max(wait, 0.0),
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        return results

    def close(self, wait: bool = True) -> None:
        """Releases the workers, after the running calls end if `wait` (an abandoned call
        that never returns would block it: pass wait=False then). Idempotent."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> "ToolPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def map_calls(fn: Callable[[Item], ExecutionResult], items: Sequence[Item], *,
              max_workers: int | None = None,
              timeout_s: float | None = None) -> list[ExecutionResult]:
    """One batch through a temporary `ToolPool` (prefer a long-lived pool in a loop)."""
    pool = ToolPool(max_workers)
    try:
        return pool.map(fn, items, timeout_s=timeout_s)
    finally:
        pool.close(wait=False)  # every result is in; abandoned calls end on their own

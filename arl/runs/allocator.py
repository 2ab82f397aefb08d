"""Host memory allocator settings for CPU training (glibc malloc).

On the CPU, XLA allocates every execution's buffers (the scratch of one whole train
step: 39 MiB at the smallest peers-benchmark size, 1.4 GiB at the modest one) with the C
library's `malloc` and frees them when the step ends. glibc hands blocks above its mmap
threshold (128 KiB, adapting up to 32 MiB) out as fresh anonymous mappings and unmaps
them on `free`, so the next step touches brand-new pages: one page fault (and the
kernel zeroing the page) per 4 KiB, every step. Measured on a 2-core VM: 10,100 faults
per toy train step of 32-41 ms; with the settings below none, and 24-32 ms
(docs/performance.md, "The host allocator").

`keep_freed_memory()` sets, through `mallopt`:

* M_MMAP_MAX = 0: no block is served by its own mapping; large blocks come from the
  heap, where a freed block is reused by the next step without faulting;
* M_TRIM_THRESHOLD = -1: the heap is never shrunk, so the pages stay mapped.

The process then keeps its high-water mark of memory instead of returning freed memory
to the system, which a training process reaches again at every step anyway. Blocks
larger than one thread arena's heap (64 MiB) requested by a thread other than the main
one are still mapped afresh by glibc whatever the settings (the 1.4 GiB scratch of the
modest benchmark step is one: 374,000 faults per step); `GLIBC_TUNABLES=
glibc.malloc.arena_max=1` in the environment before the process starts removes those
too, at the price of one shared arena for every thread (measured: the modest step 1.11x
faster, the toy one 0.82x).

Which thread allocates matters: JAX dispatches a CPU computation asynchronously, to a
worker thread, whose allocations come from that thread's own arena. `run_computations_inline()`
(before JAX starts its CPU backend) makes single-device computations run on the calling
thread instead, so a step's buffers come from the main heap, whose blocks `keep_freed_memory`
keeps at any size: no faults left in the modest step either, measured 1.2-1.4x faster
(the toy step no slower).

Who applies them (this module is the one place that decides). Both concern the CPU
only: the dispatch switch is read by JAX's CPU client alone, and the trainer keeps freed
memory only when JAX's default backend is the CPU, so its GPU and TPU runs keep glibc's
defaults.

* `TokenTrainer` itself, so that a notebook or script that builds one gets them:
  `trainer_settings_before_backend` (called before the constructor's first device
  query) runs computations inline when JAX's backend has not started yet and the config
  runs the fused step (not with `rollout.policy_lag` > 0 or a `rollout.mesh`: the
  asynchronous loop overlaps the two programs through asynchronous dispatch, and a
  one-device program run inline would block it, docs/async.md);
  `trainer_settings_after_backend` then keeps freed memory on the CPU and logs one line
  saying what the trainer set and how to opt out (once per process);
* the training CLI (`experiments/train.py`) from its start (compiling gains nothing from
  `keep_freed_memory`; the default bandit run took the same time either way), and
  `arl.runs.experiment.run` after the first step of any trainer.

Opting out: `ARL_KEEP_FREED_MEMORY=0` in the environment, or `keep_process_defaults()`
before building a trainer, keeps JAX's and glibc's defaults everywhere above.
`keep_freed_memory` does nothing (and returns False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import jax
from absl import logging

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

ENV_VAR = "ARL_KEEP_FREED_MEMORY"
_freed_memory_kept = False  # keep_freed_memory() succeeded in this process
# The same two settings as glibc tunables, for a process started with them
# (GLIBC_TUNABLES=...): e.g. another library's worker measured beside arl.
GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=" + str(2**63)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it (musl, macOS: AttributeError)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Makes glibc keep freed memory mapped for reuse (see the module docstring).

    Returns True when both settings were applied, False where the C library is not glibc
    or refused a setting. Safe to call more than once and at any time; blocks already
    mapped keep their pages until freed.
    """
    global _freed_memory_kept
    libc = _glibc()
    if libc is None:
        return False
    _freed_memory_kept = (bool(libc.mallopt(_M_MMAP_MAX, 0))
                          and bool(libc.mallopt(_M_TRIM_THRESHOLD, -1)))
    return _freed_memory_kept


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a JAX without it: assume not started
        return False


def run_computations_inline() -> bool:
    """Runs single-device CPU computations on the thread that calls them (JAX's
    `jax_cpu_enable_async_dispatch` off), so their buffers come from the main heap.

    Only takes effect before JAX creates its CPU backend (the first computation or device
    query); returns True when set in time, False (with a warning) when the backend had
    already started. Computations over several devices are dispatched as before. A
    Python loop around a compiled step then waits for each step to finish before its
    next line, which a training loop reading the step's metrics does anyway.
    """
    if _backends_started():
        logging.warning("run_computations_inline: JAX's backend has already started; "
                        "CPU computations stay asynchronously dispatched.")
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


_process_defaults_kept = False  # keep_process_defaults() was called
_trainer_line_logged = False


def keep_process_defaults() -> None:
    """Keeps JAX's and glibc's defaults in this process: `TokenTrainer` and the
    `*_unless_disabled` calls (the CLI's, `arl.runs.experiment.run`'s) then change
    neither setting, as with `ARL_KEEP_FREED_MEMORY=0`. Call it before building a
    trainer; settings already applied stay (`run_computations_inline` cannot be undone
    once the backend runs)."""
    global _process_defaults_kept
    _process_defaults_kept = True


def applied() -> tuple[bool, bool]:
    """(CPU computations run inline, glibc keeps freed memory) in this process now."""
    return not jax.config.read("jax_cpu_enable_async_dispatch"), _freed_memory_kept


def _disabled() -> bool:
    return _process_defaults_kept or os.environ.get(ENV_VAR, "1").strip().lower() in (
        "0", "false", "no", "off")


def keep_freed_memory_unless_disabled() -> bool:
    """`keep_freed_memory()` unless the environment sets ARL_KEEP_FREED_MEMORY=0."""
    return False if _disabled() else keep_freed_memory()


def run_computations_inline_unless_disabled() -> bool:
    """`run_computations_inline()` unless the environment sets ARL_KEEP_FREED_MEMORY=0."""
    return False if _disabled() else run_computations_inline()


def trainer_settings_before_backend(*, two_programs: bool) -> bool:
    """The token trainer's first half (before its first device query): runs computations
    inline when nothing opted out, JAX's backend has not started and the config runs the
    fused step (`two_programs` False). Returns whether it changed the setting."""
    if (_disabled() or two_programs or _backends_started()
            or not jax.config.read("jax_cpu_enable_async_dispatch")):
        return False
    return run_computations_inline()


def trainer_settings_after_backend(*, set_inline: bool) -> None:
    """The token trainer's second half (JAX's backend started): keeps freed memory when
    the default backend is the CPU and nothing opted out, and logs one line (once per
    process) saying what the trainer set and how to opt out. `set_inline`: what
    `trainer_settings_before_backend` returned."""
    global _trainer_line_logged
    kept = (not _disabled() and not _freed_memory_kept and jax.default_backend() == "cpu"
            and keep_freed_memory())
    if not (kept or set_inline) or _trainer_line_logged:
        return
    _trainer_line_logged = True
    applied = [what for what, done in (
        ("JAX's CPU computations run on the calling thread (jax_cpu_enable_async_dispatch="
         "False)", set_inline), ("glibc keeps freed memory mapped", kept)) if done]
    logging.warning("TokenTrainer set the CPU host settings of arl.runs.allocator for "
                    "faster steps: %s; ARL_KEEP_FREED_MEMORY=0 or "
                    "arl.runs.allocator.keep_process_defaults() before building a "
                    "trainer keeps the defaults.", " and ".join(applied))

"""Process-wide settings for training, applied in one place: `setup()` (`arl.setup`).

    import arl
    arl.setup()          # a notebook's first cell; the CLI and `experiment.run` call it

Building a trainer, `init_state` and `train_step` change nothing global: a notebook or
another JAX codebase that never calls `setup` keeps JAX's and glibc's defaults. `setup`
applies, each where the user has not chosen otherwise:

* JAX's persistent compilation cache (`arl.caches.enable_compilation_cache`: the compiled
  step is most of a short run's start-up; ``ARL_COMPILATION_CACHE=0`` turns it off);
* on the CPU, the two host settings below (``ARL_KEEP_FREED_MEMORY=0`` keeps the
  defaults).

The host settings. On the CPU, XLA allocates every execution's buffers (the scratch of
one whole train step: 39 MiB at the smallest peers-benchmark size, 1.4 GiB at the modest
one) with the C library's `malloc` and frees them when the step ends. glibc hands blocks
above its mmap threshold (128 KiB, adapting up to 32 MiB) out as fresh anonymous
mappings and unmaps them on `free`, so the next step touches brand-new pages: one page
fault (and the kernel zeroing the page) per 4 KiB, every step. Measured on a 2-core VM:
10,100 faults per toy train step of 32-41 ms; with the settings below none, and 24-32 ms
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
(the toy step no slower). Not with two programs (`rollout.policy_lag` > 0 or a
`rollout.mesh`): the asynchronous loop overlaps rollout and update through asynchronous
dispatch, and a one-device program run inline would block it (docs/async.md), so
`setup(config)` leaves dispatch asynchronous for such a config. Both settings concern the
CPU only: the dispatch switch is read by JAX's CPU client alone, and freed memory is kept
only when JAX's default backend is the CPU, so GPU and TPU runs keep glibc's defaults.
`keep_freed_memory` does nothing (and returns False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os

import jax
import ml_collections
from absl import logging

from arl import caches
from arl import config as config_lib

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


def applied() -> tuple[bool, bool]:
    """(CPU computations run inline, glibc keeps freed memory) in this process now."""
    return not jax.config.read("jax_cpu_enable_async_dispatch"), _freed_memory_kept


def _host_settings_disabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `setup` found in force when it returned."""

    compilation_cache: str | None  # the persistent cache's directory; None: no cache
    computations_inline: bool  # JAX's CPU computations run on the calling thread
    freed_memory_kept: bool  # glibc keeps freed memory mapped


def _runs_two_programs(config: ml_collections.ConfigDict) -> bool:
    """`config_lib.uses_two_programs` before validation: a config too malformed to tell
    counts as two programs (dispatch stays asynchronous; `validate` then names the field)."""
    try:
        return config_lib.uses_two_programs(config)
    except (AttributeError, KeyError, TypeError):
        return True


def setup(config: ml_collections.ConfigDict | None = None) -> Settings:
    """Applies arl's process settings (the module docstring): the compilation cache, and
    on the CPU computations run inline and freed memory kept.

    Call it first, before anything runs on a device: running computations inline can
    only be set before JAX starts its backend (later it stays as it is). `config`: the
    experiment to be run, when known; a config that runs two programs (a policy lag or a
    rollout mesh) keeps asynchronous dispatch. Idempotent; with a multi-host run, call it
    after `jax.distributed.initialize`.
    """
    cache = caches.enable_compilation_cache()
    two_programs = config is not None and _runs_two_programs(config)
    if not _host_settings_disabled():
        if (not two_programs and not _backends_started()
                and jax.config.read("jax_cpu_enable_async_dispatch")):
            run_computations_inline()
        if not _freed_memory_kept and jax.default_backend() == "cpu":
            keep_freed_memory()
    inline, kept = applied()
    if two_programs and inline:
        logging.warning(
            "arl.setup: JAX's CPU computations run inline (an earlier arl.setup() without "
            "this config set it), so the rollout and update programs overlap less; call "
            "arl.setup(config) first in the process for a policy lag or a rollout mesh.")
    return Settings(compilation_cache=cache, computations_inline=inline,
                    freed_memory_kept=kept)

"""What arl keeps between runs: its cache directory and JAX's persistent compilation cache.

    from arl import caches
    caches.enable_compilation_cache()   # `arl.setup()` calls it; idempotent

The compiled train step is most of a short run's start-up (`benchmarks/first_step.py`):
the quickstart's step compiled in 32-103 s on a busy 2-core CPU and loaded from the
cache in 2.5-5 s. So `arl.setup()` (called by the CLI, `arl.runs.experiment.run` and a
notebook's first cell) turns on JAX's persistent compilation cache, in this order of
precedence:

1. ``ARL_COMPILATION_CACHE=0`` (or ``off``, ``false``, ``no``) turns it off; any other
   value names the directory to use.
2. A cache the user configured JAX with (``JAX_COMPILATION_CACHE_DIR``,
   ``jax.config.update("jax_compilation_cache_dir", ...)``), or a cache the user turned
   off (``jax_enable_compilation_cache=False``), is left as it is, thresholds included.
3. Otherwise ``cache_root()/jax``: per user, shared by every workdir, so a notebook's
   tenth variant of a config and a fresh workdir reuse what the first one compiled.

JAX keys an entry by the program, the jaxlib version, the XLA flags, the compile options
and the devices' topology (on the CPU its fingerprint changes with the instruction set,
`--xla_cpu_max_isa`), so a shared home directory on processors of different kinds does
not load one's code on the other. An entry is the compiled program: a hit runs the same
machine code as a fresh compile, so no number changes (the golden runs pass with a warm
cache; docs/performance.md, "Start-up and the compilation cache"). Arl caches every program that takes more than
`MIN_COMPILE_SECS` to compile (JAX's default, 1 s, would leave out the small programs a
run starts with) and bounds the directory at `MAX_CACHE_BYTES`, least recently used out
first; under that bound JAX also locks the directory, so parallel runs (pytest-xdist
workers, several runs of a sweep) can share it.
"""

from __future__ import annotations

import os

import jax

CACHE_ENV = "ARL_CACHE_DIR"  # arl's cache root (datasets built on first use, compiled code)
COMPILATION_CACHE_ENV = "ARL_COMPILATION_CACHE"  # "0"/"off": no cache; else its directory
_OFF = ("0", "off", "false", "no")
# Reading an entry back costs a few milliseconds; compiling the smallest programs a run
# starts with (a random split, an iota) 10-150 ms each on the 2-core CPU.
MIN_COMPILE_SECS = 0.05
MAX_CACHE_BYTES = 4 << 30  # the quickstart's programs take 1.3 MB
_JAX_DEFAULT_MIN_COMPILE_SECS = 1.0
_JAX_THRESHOLD_ENVS = ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                       "JAX_COMPILATION_CACHE_MAX_SIZE")


def cache_root() -> str:
    """arl's cache directory: $ARL_CACHE_DIR, else $XDG_CACHE_HOME/arl, else ~/.cache/arl."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "arl")


def enable_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache unless the user chose otherwise (the
    module docstring gives the precedence); returns the directory in use, or None when
    there is none. Safe to call at any time: JAX opens the cache at its next compile."""
    setting = os.environ.get(COMPILATION_CACHE_ENV, "").strip()
    if setting.lower() in _OFF:
        return None
    if not jax.config.jax_enable_compilation_cache:
        return None
    if jax.config.jax_compilation_cache_dir:  # the user's own cache, their settings
        return jax.config.jax_compilation_cache_dir
    path = os.path.abspath(os.path.expanduser(setting or os.path.join(cache_root(), "jax")))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only home: run without a cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if not any(name in os.environ for name in _JAX_THRESHOLD_ENVS):
        if jax.config.jax_persistent_cache_min_compile_time_secs == \
                _JAX_DEFAULT_MIN_COMPILE_SECS:
            jax.config.update("jax_persistent_cache_min_compile_time_secs",
                              MIN_COMPILE_SECS)
        if jax.config.jax_compilation_cache_max_size == -1 and _has_filelock():
            jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    return path


def _has_filelock() -> bool:
    """JAX bounds the cache (and locks it against concurrent writers) with `filelock`."""
    try:
        import filelock  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return False
    return True

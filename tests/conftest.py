"""Shared test setup: eight fake CPU devices so sharded tests run in-process, a cheaper
XLA backend, and one persistent compilation cache per test run shared by the xdist
workers. Most of the suite's time is compiling small programs, not running them."""

import os
import shutil
import tempfile

from tests import xla_flags

# Before JAX initialises its backends; the xdist workers inherit the controller's
# setting (tests/xla_flags.py says which flags and why).
xla_flags.set_suite_flags()
# A test worker runs hundreds of short programs, mostly compiling: it keeps glibc's
# defaults (tests/test_process_settings.py checks `arl.setup()` in a subprocess).
os.environ.setdefault("ARL_KEEP_FREED_MEMORY", "0")

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_DATA_CACHE_ENV = "ARL_CACHE_DIR"  # datasets built on first use (arl.data.text_tasks)


def pytest_configure(config):
    """The controller makes a fresh compilation cache directory before the xdist workers
    start (they inherit the environment): many tests compile the same small trainer
    programs, and each is then compiled once per run instead of once per test module.
    The cache is per run, so a run's time does not depend on an earlier run."""
    if hasattr(config, "workerinput"):
        return
    if not os.environ.get(_DATA_CACHE_ENV):  # per run too: no dataset left from an earlier run
        config._arl_data_cache = tempfile.mkdtemp(prefix="arl-data-cache-")
        os.environ[_DATA_CACHE_ENV] = config._arl_data_cache
    if os.environ.get(_CACHE_ENV):
        return
    config._arl_jax_cache = tempfile.mkdtemp(prefix="arl-jax-cache-")
    os.environ[_CACHE_ENV] = config._arl_jax_cache
    # Cache what takes a noticeable time to compile; tiny programs are cheaper to rebuild.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    # A bound makes JAX lock the directory (filelock) around each read and write: the
    # two workers often compile the same program at once, and unlocked, one may read the
    # other's entry half written (JAX then warns and compiles again).
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))


def pytest_unconfigure(config):
    for cache in (getattr(config, "_arl_jax_cache", None),
                  getattr(config, "_arl_data_cache", None)):
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Schedules for `pytest -n 2 --dist loadgroup` (pytest.ini): a module's tests share a
    worker (its module-scoped fixtures, e.g. a compiled trainer, are built once), except in
    modules that set `SPREAD_OVER_WORKERS = True` (long independent learning runs), whose
    tests are scheduled one by one so both workers share them."""
    import pytest

    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        module = getattr(item, "module", None)
        spread = getattr(module, "SPREAD_OVER_WORKERS", False)
        group = item.nodeid if spread else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))

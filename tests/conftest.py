"""Shared test setup: eight fake CPU devices so sharded tests run in-process."""

import os

# Must happen before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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

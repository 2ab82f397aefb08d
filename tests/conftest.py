"""Shared test setup: eight fake CPU devices so sharded tests run in-process."""

import os

# Must happen before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

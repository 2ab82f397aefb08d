"""The XLA flags of the test suite (`tests/conftest.py`) and of golden-run recording
(`python -m tests.golden_run --record`): the goldens are the numbers computed under them.

* eight fake CPU devices, so sharded tests run in-process;
* LLVM optimisation level 0: the trainer programs compile about a third faster;
* XLA:CPU's legacy (elemental) fusion emitters instead of the MLIR ones: they compile
  the trainer programs about twice as fast at level 0 (the default suite took 8:14
  instead of 13:07 on the 2-core development machine). At XLA's default level they
  neither shorten the quickstart's first step nor keep its step time (10-20 % slower),
  which is why only the tests use them. They round some fused ops differently (goldens recorded
  under one setting differ in the last bits under the other), so where this XLA no
  longer has the flag the suite runs without it and the golden runs report differences.

The tests check numbers, not CPU speed; `benchmarks/` measure at XLA's defaults.
"""

from __future__ import annotations

import os
import subprocess
import sys

BASE = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
LEGACY_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _accepted(flags: str) -> bool:
    """Whether this JAX's XLA starts with `flags` (it exits on a flag it does not know)."""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, check=False, timeout=120)
    return probe.returncode == 0


def suite_flags() -> str:
    flags = f"{BASE} {LEGACY_FUSION_EMITTERS}"
    return flags if _accepted(flags) else BASE


def set_suite_flags() -> None:
    """Sets XLA_FLAGS (and JAX_PLATFORMS=cpu) unless the caller's environment has them;
    before JAX starts its backend."""
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = suite_flags()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

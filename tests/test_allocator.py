"""arl.runs.allocator: glibc keeps freed memory mapped, so a repeated large allocation
stops page-faulting, and a compiled step run inline reuses its scratch at any size
(measured in subprocesses: the settings are process-wide)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from arl.runs import allocator

_FAULTS_PROGRAM = r"""
import ctypes, json, resource, sys
from arl.runs import allocator

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 48 << 20  # above glibc's largest automatic mmap threshold (32 MiB)

def faults_of_one_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)  # touch every page
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = [faults_of_one_block() for _ in range(3)]
applied = allocator.keep_freed_memory()
kept = [faults_of_one_block() for _ in range(3)]
print(json.dumps(dict(default=default, applied=applied, kept=kept)))
"""


# A jitted step with a 95 MiB temporary (above a thread arena's 64 MiB heap): run by JAX's
# dispatch thread, glibc maps it afresh at every call whatever the settings; run inline on
# the main thread, the kept heap serves it again.
_STEP_FAULTS_PROGRAM = r"""
import json, resource, sys
import jax, jax.numpy as jnp
from arl.runs import allocator

inline = allocator.run_computations_inline() if sys.argv[1] == "inline" else False
kept = allocator.keep_freed_memory()

@jax.jit
def step(x):
    return jnp.sum(jnp.sin(jnp.outer(x, x)), axis=0)

x = jnp.linspace(0.0, 1.0, 5000, dtype=jnp.float32)
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(dict(inline=inline, kept=kept, faults=faults,
                      late=allocator.run_computations_inline())))
"""


def _is_glibc() -> bool:
    return allocator._glibc() is not None  # pylint: disable=protected-access


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _is_glibc(),
                    reason="glibc malloc only")
def test_a_freed_block_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", _FAULTS_PROGRAM], capture_output=True,
                         text=True, check=True, timeout=120)
    faults = json.loads(out.stdout.strip().splitlines()[-1])
    assert faults["applied"] is True
    pages = (48 << 20) // 4096
    # glibc's default: every allocation of the 48 MiB block is a fresh mapping, faulted in
    # page by page (fewer faults where the kernel backs it with huge pages).
    assert min(faults["default"]) > pages // 600, faults
    # Kept: the first allocation after the switch grows the heap (faults once), the next
    # ones reuse it.
    assert faults["kept"][1] < 50 and faults["kept"][2] < 50, faults
    assert faults["kept"][2] * 20 < min(faults["default"]), faults


def _step_faults(mode):
    # One compute thread: other threads' small blocks in the main heap are what makes it
    # grow again now and then, more often on a loaded machine.
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
    out = subprocess.run([sys.executable, "-c", _STEP_FAULTS_PROGRAM, mode], env=env,
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _is_glibc(),
                    reason="glibc malloc only")
def test_a_step_run_inline_reuses_its_scratch_without_page_faults():
    dispatched, inline = _step_faults("dispatched"), _step_faults("inline")
    assert inline["inline"] is True and inline["kept"] is True
    # Too late once the backend runs: the setting is refused, not silently half-applied.
    assert inline["late"] is False and dispatched["late"] is False
    pages = (5000 * 5000 * 4) // 4096
    # Dispatched to a worker thread, the temporary is a fresh mapping at nearly every call.
    assert statistics.median(dispatched["faults"][1:]) > pages // 4, dispatched
    # Inline, most calls reuse the main heap's block without a fault; now and then the
    # heap grows (another thread's small block can split the freed one).
    assert statistics.median(inline["faults"][1:]) < 100, inline


@pytest.mark.parametrize("setting", ["keep_freed_memory", "run_computations_inline"])
def test_environment_switch_disables_it(monkeypatch, setting):
    called = []
    monkeypatch.setattr(allocator, setting, lambda: called.append(1) or True)
    unless_disabled = getattr(allocator, f"{setting}_unless_disabled")
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(allocator.ENV_VAR, off)
        assert unless_disabled() is False
    assert not called
    monkeypatch.setenv(allocator.ENV_VAR, "1")
    assert unless_disabled() is True
    monkeypatch.delenv(allocator.ENV_VAR)
    assert unless_disabled() is True
    assert len(called) == 2


def test_without_glibc_it_is_a_no_op(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    assert allocator.keep_freed_memory() is False

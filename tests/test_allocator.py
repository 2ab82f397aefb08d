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


# A notebook's flow: import, build a TokenTrainer (nothing else touched JAX before), then
# observe glibc (a freed 48 MiB block reused without faults) and JAX's dispatch setting.
_NOTEBOOK_PROGRAM = r"""
import ctypes, json, resource, sys
import jax
from arl.config import default_config
from arl.runs import allocator
from arl.trainers import TokenTrainer

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 48 << 20

def faults_of_one_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "opt_out":
    allocator.keep_process_defaults()
c = default_config()
c.rollout.num_tasks, c.rollout.group_size = 2, 2
if sys.argv[1] == "two_programs":
    c.rollout.policy_lag, c.loss.off_policy_correction = 1, "tis"
TokenTrainer(c)
print(json.dumps(dict(async_dispatch=jax.config.read("jax_cpu_enable_async_dispatch"),
                      faults=[faults_of_one_block() for _ in range(3)])))
"""


def _notebook(mode):
    env = {k: v for k, v in os.environ.items() if k != allocator.ENV_VAR}
    return subprocess.Popen([sys.executable, "-c", _NOTEBOOK_PROGRAM, mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _is_glibc(),
                    reason="glibc malloc only")
def test_a_token_trainer_applies_the_host_settings_itself():
    """Built in a fresh process, `TokenTrainer` runs computations inline and keeps freed
    memory (one warning line says so and how to opt out); with two programs it keeps
    asynchronous dispatch."""
    runs = {mode: _notebook(mode) for mode in ("fused", "two_programs")}
    out = {}
    for mode, process in runs.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
        out[mode] = (json.loads(stdout.strip().splitlines()[-1]),
                     [line for line in stderr.splitlines() if "TokenTrainer set" in line])
    fused, lines = out["fused"]
    assert fused["async_dispatch"] is False
    # The heap keeps the freed block (glibc's default maps it afresh: ~12,000 faults).
    assert max(fused["faults"][1:]) < 50, fused
    assert len(lines) == 1 and "jax_cpu_enable_async_dispatch=False" in lines[0]
    assert "glibc keeps freed memory" in lines[0] and "ARL_KEEP_FREED_MEMORY=0" in lines[0]
    two, lines = out["two_programs"]
    assert two["async_dispatch"] is True
    assert max(two["faults"][1:]) < 50, two
    assert len(lines) == 1 and "async_dispatch" not in lines[0]


@pytest.mark.parametrize("opt_out", ["environment", "function"])
def test_opting_out_keeps_the_trainer_from_changing_the_settings(monkeypatch, opt_out):
    """ARL_KEEP_FREED_MEMORY=0 or `keep_process_defaults()`: the trainer's two halves
    change neither setting and log nothing (here on a backend not yet started, as in a
    fresh notebook); without either they would."""
    changed = []
    monkeypatch.setattr(allocator, "_backends_started", lambda: False)
    monkeypatch.setattr(allocator.jax.config, "update",
                        lambda *args: changed.append(args))
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: changed.append("kept") or True)
    monkeypatch.setattr(allocator, "_freed_memory_kept", False)
    monkeypatch.setattr(allocator, "_process_defaults_kept", False)
    monkeypatch.delenv(allocator.ENV_VAR, raising=False)
    logged = []
    monkeypatch.setattr(allocator.logging, "warning", lambda *args: logged.append(args))
    monkeypatch.setattr(allocator, "_trainer_line_logged", False)
    assert allocator.trainer_settings_before_backend(two_programs=True) is False
    if opt_out == "environment":
        monkeypatch.setenv(allocator.ENV_VAR, "0")
    else:
        allocator.keep_process_defaults()
    assert allocator.trainer_settings_before_backend(two_programs=False) is False
    allocator.trainer_settings_after_backend(set_inline=False)
    assert not changed and not logged
    monkeypatch.setattr(allocator, "_process_defaults_kept", False)
    monkeypatch.delenv(allocator.ENV_VAR, raising=False)
    assert allocator.trainer_settings_before_backend(two_programs=False) is True
    allocator.trainer_settings_after_backend(set_inline=True)
    assert changed == [("jax_cpu_enable_async_dispatch", False), "kept"]
    assert len(logged) == 1

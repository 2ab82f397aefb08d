"""arl.runs.process_settings (`arl.setup`): glibc keeps freed memory mapped, so a repeated
large allocation stops page-faulting, and a compiled step run inline reuses its scratch
at any size; `arl.setup()` is the one place that applies them, and building a trainer
changes nothing global (measured in subprocesses: the settings are process-wide)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from arl.runs import process_settings

_FAULTS_PROGRAM = r"""
import ctypes, json, resource, sys
from arl.runs import process_settings

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
applied = process_settings.keep_freed_memory()
kept = [faults_of_one_block() for _ in range(3)]
print(json.dumps(dict(default=default, applied=applied, kept=kept)))
"""


# A jitted step with a 95 MiB temporary (above a thread arena's 64 MiB heap): run by JAX's
# dispatch thread, glibc maps it afresh at every call whatever the settings; run inline on
# the main thread, the kept heap serves it again.
_STEP_FAULTS_PROGRAM = r"""
import json, resource, sys
import jax, jax.numpy as jnp
from arl.runs import process_settings

inline = process_settings.run_computations_inline() if sys.argv[1] == "inline" else False
kept = process_settings.keep_freed_memory()

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
                      late=process_settings.run_computations_inline())))
"""


def _is_glibc() -> bool:
    return process_settings._glibc() is not None  # pylint: disable=protected-access


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


def test_without_glibc_it_is_a_no_op(monkeypatch):
    monkeypatch.setattr(process_settings, "_glibc", lambda: None)
    assert process_settings.keep_freed_memory() is False


# A notebook's flow in a fresh process: import, maybe `arl.setup(...)` first, build a
# TokenTrainer and its initial state; then what is global: jax.config, os.environ, and
# glibc (a freed 48 MiB block reused without faults, or mapped afresh as by default).
_NOTEBOOK_PROGRAM = r"""
import ctypes, json, os, resource, sys
import jax
import arl
from arl.config import default_config
from arl.runs import process_settings

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

c = default_config()
c.rollout.num_tasks, c.rollout.group_size = 2, 2
c.model.d_model, c.model.num_heads, c.model.num_kv_heads, c.model.mlp_dim = 32, 4, 2, 64
if sys.argv[1] == "two_programs":
    c.rollout.policy_lag, c.loss.off_policy_correction = 1, "tis"
settings = arl.setup(c) if sys.argv[1] != "no_setup" else None
config_before, environ_before = dict(jax.config.values), dict(os.environ)
trainer = arl.build(c)
jax.block_until_ready(trainer.init_state())
changed = sorted(k for k in set(config_before) | set(jax.config.values)
                 if config_before.get(k) != jax.config.values.get(k))
environ_changed = sorted(k for k in set(environ_before) | set(os.environ)
                         if environ_before.get(k) != os.environ.get(k))
print(json.dumps(dict(
    changed=changed, environ_changed=environ_changed, applied=process_settings.applied(),
    async_dispatch=jax.config.read("jax_cpu_enable_async_dispatch"),
    cache=jax.config.jax_compilation_cache_dir,
    settings=None if settings is None else [settings.compilation_cache,
        settings.computations_inline, settings.freed_memory_kept],
    faults=[faults_of_one_block() for _ in range(3)])))
"""


def _notebook(mode, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in (process_settings.ENV_VAR, "JAX_COMPILATION_CACHE_DIR",
                        "ARL_COMPILATION_CACHE")}
    env["ARL_CACHE_DIR"] = str(tmp_path / mode)
    return subprocess.Popen([sys.executable, "-c", _NOTEBOOK_PROGRAM, mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _is_glibc(),
                    reason="glibc malloc only")
def test_only_setup_changes_the_process(tmp_path):
    """Without `arl.setup`, building a trainer and its initial state leaves jax.config,
    the environment and glibc's allocator as they were (a freed 48 MiB block is mapped
    afresh, faulting page by page). `arl.setup()` turns on the compilation cache, runs
    computations inline and keeps freed memory; `arl.setup(config)` with two programs
    keeps asynchronous dispatch."""
    runs = {mode: _notebook(mode, tmp_path) for mode in ("no_setup", "fused", "two_programs")}
    out = {}
    for mode, process in runs.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
        out[mode] = json.loads(stdout.strip().splitlines()[-1])
    pages = (48 << 20) // 4096
    bare = out["no_setup"]
    assert bare["changed"] == [] and bare["environ_changed"] == [], bare
    assert bare["applied"] == [False, False] and bare["async_dispatch"] is True
    assert bare["cache"] in (None, "") and not (tmp_path / "no_setup").exists()
    assert min(bare["faults"]) > pages // 600, bare  # glibc's defaults
    fused = out["fused"]
    assert fused["settings"] == [str(tmp_path / "fused" / "jax"), True, True], fused
    assert fused["cache"] == str(tmp_path / "fused" / "jax")
    assert fused["changed"] == [] and fused["environ_changed"] == [], fused
    assert fused["async_dispatch"] is False
    assert max(fused["faults"][1:]) < 50, fused  # the heap keeps the freed block
    two = out["two_programs"]
    assert two["settings"] == [str(tmp_path / "two_programs" / "jax"), False, True], two
    assert two["changed"] == [] and two["async_dispatch"] is True
    assert max(two["faults"][1:]) < 50, two


def test_the_environment_switch_keeps_the_host_defaults(monkeypatch):
    """ARL_KEEP_FREED_MEMORY=0: `setup` changes neither host setting (here on a backend not
    yet started, as in a fresh notebook); without it, it changes both."""
    changed = []
    monkeypatch.setattr(process_settings, "_backends_started", lambda: False)
    monkeypatch.setattr(process_settings, "run_computations_inline",
                        lambda: changed.append("inline") or True)
    monkeypatch.setattr(process_settings, "keep_freed_memory",
                        lambda: changed.append("kept") or True)
    monkeypatch.setattr(process_settings, "_freed_memory_kept", False)
    monkeypatch.setattr(process_settings.caches, "enable_compilation_cache", lambda: None)
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(process_settings.ENV_VAR, off)
        process_settings.setup()
    assert not changed
    monkeypatch.delenv(process_settings.ENV_VAR)
    process_settings.setup()
    assert changed == ["inline", "kept"]

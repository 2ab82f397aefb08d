"""arl's persistent compilation cache (arl/caches.py): who decides where it is, and that a
second process loads the train step from it, computing the same numbers."""

import json
import os
import subprocess
import sys

import jax
import pytest

from arl import caches

_JAX_SETTINGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
                 "jax_persistent_cache_min_compile_time_secs",
                 "jax_compilation_cache_max_size")


@pytest.fixture
def fresh_jax_cache_settings(monkeypatch):
    """JAX's cache settings at their defaults for the test, restored after it (the suite
    itself runs with a cache of its own, tests/conftest.py); no arl variables set."""
    saved = {name: getattr(jax.config, name) for name in _JAX_SETTINGS}
    for name, value in (("jax_compilation_cache_dir", None),
                        ("jax_enable_compilation_cache", True),
                        ("jax_persistent_cache_min_compile_time_secs", 1.0),
                        ("jax_compilation_cache_max_size", -1)):
        jax.config.update(name, value)
    for name in (caches.COMPILATION_CACHE_ENV, caches.CACHE_ENV, "XDG_CACHE_HOME",
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_COMPILATION_CACHE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_the_cache_goes_under_arls_cache_root_and_caches_small_programs(
        fresh_jax_cache_settings, tmp_path, monkeypatch):
    del fresh_jax_cache_settings
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert caches.enable_compilation_cache() == str(tmp_path / "home/.cache/arl/jax")
    monkeypatch.setenv(caches.CACHE_ENV, str(tmp_path / "root"))
    jax.config.update("jax_compilation_cache_dir", None)
    path = caches.enable_compilation_cache()
    assert path == str(tmp_path / "root" / "jax") and os.path.isdir(path)
    assert jax.config.jax_compilation_cache_dir == path
    assert jax.config.jax_persistent_cache_min_compile_time_secs == caches.MIN_COMPILE_SECS
    assert jax.config.jax_compilation_cache_max_size == caches.MAX_CACHE_BYTES
    assert caches.enable_compilation_cache() == path  # idempotent


def test_the_opt_out_and_the_users_own_settings_come_first(
        fresh_jax_cache_settings, tmp_path, monkeypatch):
    del fresh_jax_cache_settings
    monkeypatch.setenv(caches.CACHE_ENV, str(tmp_path / "root"))
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv(caches.COMPILATION_CACHE_ENV, off)
        assert caches.enable_compilation_cache() is None
        assert jax.config.jax_compilation_cache_dir is None
    assert not (tmp_path / "root").exists()
    # A directory of the user's choosing through arl's variable.
    monkeypatch.setenv(caches.COMPILATION_CACHE_ENV, str(tmp_path / "mine"))
    assert caches.enable_compilation_cache() == str(tmp_path / "mine")
    # JAX configured by the user: its directory and thresholds stay.
    monkeypatch.delenv(caches.COMPILATION_CACHE_ENV)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax.config.update("jax_compilation_cache_max_size", -1)
    assert caches.enable_compilation_cache() == str(tmp_path / "theirs")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
    assert jax.config.jax_compilation_cache_max_size == -1
    # ... and so does a user's threshold in JAX's environment variable.
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")
    assert caches.enable_compilation_cache() == str(tmp_path / "root" / "jax")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
    # A cache the user turned off stays off.
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    assert caches.enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None


# A fresh process builds a tiny trainer and runs one step; it reports which programs JAX
# compiled, which of them it loaded from the persistent cache (the hit event comes
# inside the compile's span, whose end names the program), and the step's metrics.
_BUILD_AND_STEP = r"""
import json, sys
import jax
hits, programs = [], []
def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
        hits.append(True)
def on_span(event, start, end, fun_name="", **_):
    if event == "/jax/core/compile/backend_compile_duration":
        programs.append([fun_name, bool(hits)])
        hits.clear()
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_time_span_listener(on_span)
import arl
arl.setup()  # a notebook's first cell
from arl import trainers
if sys.argv[1] == "vector":
    from tests.test_experiment import _tiny_vector_config as tiny_config
else:
    from tests.test_train import tiny_config
trainer = trainers.build(tiny_config())
state, metrics = trainer.train_step(trainer.init_state())
print("@@" + json.dumps(dict(programs=programs, metrics={
    k: float(v).hex() for k, v in jax.device_get(metrics).items()})))
"""


def _build_and_step(trainer, env):
    done = subprocess.run([sys.executable, "-c", _BUILD_AND_STEP, trainer], env=env,
                          text=True, capture_output=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("@@")][-1]
    return json.loads(line[2:])


@pytest.mark.parametrize("trainer,step", [
    ("vector", "jit(step)"),
    pytest.param("token", "jit(step)", marks=pytest.mark.slow),  # ~1 min: two compiles
])
def test_a_second_process_loads_the_train_step_from_the_cache(tmp_path, trainer, step):
    """`arl.setup()` turns the cache on (no JAX setting in the environment):
    the first process compiles the step and writes it, the second loads it, and both
    compute the same metrics bit for bit."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", caches.COMPILATION_CACHE_ENV)}
    env[caches.CACHE_ENV] = str(tmp_path)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    cold = _build_and_step(trainer, env)
    warm = _build_and_step(trainer, env)
    assert [hit for name, hit in cold["programs"] if name == step] == [False], cold
    assert [hit for name, hit in warm["programs"] if name == step] == [True], warm
    assert any(name.startswith("jit_step-") for name in os.listdir(tmp_path / "jax"))
    assert warm["metrics"] == cold["metrics"]

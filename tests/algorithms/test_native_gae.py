"""The C++ GAE loop (`arl.native`, `gae(method="native")`): its build, its fallback and
its numbers against the scan it replaces on CPU.

The NumPy-reference, hand-computed, rlax and hypothesis tests of tests/algorithms/
test_advantages.py run it too (it is one of their METHODS wherever it builds)."""

import functools
import os
import shutil
import subprocess
import sys
import warnings

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import algorithms as alg
from arl import native
from arl.algorithms import advantages as advantages_lib
from tests.algorithms.test_advantages import gae_reference

_COMPILER = os.environ.get("CXX") or "c++"
needs_compiler = pytest.mark.skipif(shutil.which(_COMPILER) is None,
                                    reason=f"no C++ compiler (`{_COMPILER}`) on this machine")


def _batch(seed, batch, length, boundaries):
    rng = np.random.default_rng(seed)
    normal = lambda: rng.normal(size=(batch, length)).astype(np.float32)  # noqa: E731
    args = dict(rewards=normal(), values=normal(), mask=rng.random((batch, length)) < 0.7,
                bootstrap_value=rng.normal(size=batch).astype(np.float32))
    if boundaries:
        dones = rng.random((batch, length)) < 0.1
        args.update(dones=dones, truncated=dones & (rng.random((batch, length)) < 0.5),
                    next_values=normal())
    return args


@needs_compiler
def test_builds_where_a_compiler_exists():
    # A compiler is there, so a failed build is a defect, not a reason to skip.
    assert native.available("gae")
    assert advantages_lib._resolve_method("auto") == "native"


@needs_compiler
@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 9),
                  length=st.integers(1, 70), boundaries=st.booleans(),
                  gamma=st.floats(0.0, 1.0, width=32), lam=st.floats(0.0, 1.0, width=32))
def test_equals_the_scan(seed, batch, length, boundaries, gamma, lam):
    # Not bit for bit: XLA contracts the scan's multiply-adds into FMAs differently by
    # context (constant or traced gamma, a scan it unrolls, a vmapped one); the kernel
    # always computes the carry with the same two FMAs.
    args = _batch(seed, batch, length, boundaries)
    for got, want in zip(_jit_gae(args, gamma, lam, "native"),
                         _jit_gae(args, gamma, lam, "scan")):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=3)
def _jit_gae(args, gamma, lam, method):
    return alg.gae(**args, gamma=gamma, lam=lam, method=method)


@needs_compiler
@pytest.mark.parametrize("boundaries", [False, True])
def test_rows_longer_than_a_block_match_the_numpy_loop(boundaries):
    # 6 rows: one group of 4 interleaved rows and 2 single ones; 4,500 steps: three time
    # blocks of the kernel (2,048 steps), the carry crossing both block edges.
    args = _batch(7, 6, 4500, boundaries)
    got = alg.gae(**args, gamma=0.999, lam=0.97, method="native")
    want = gae_reference(args["rewards"], args["values"], args["mask"], 0.999, 0.97,
                         args["bootstrap_value"], args.get("dones"), args.get("truncated"),
                         args.get("next_values"))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@needs_compiler
def test_vmapped_rows_and_hyperparameters():
    args = _batch(0, 4, 23, boundaries=True)
    stacked = {k: np.stack([v, v[::-1]]) for k, v in args.items()}
    got = jax.vmap(lambda a: alg.gae(**a, gamma=0.9, lam=0.8, method="native"))(stacked)
    for i in range(2):
        want = alg.gae(**{k: v[i] for k, v in stacked.items()}, gamma=0.9, lam=0.8,
                       method="native")
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g[i], w)
    gammas = jnp.array([0.5, 0.9, 1.0])
    got, _ = jax.vmap(lambda g: alg.gae(**args, gamma=g, lam=0.8, method="native"))(gammas)
    for i, gamma in enumerate([0.5, 0.9, 1.0]):
        want, _ = alg.gae(**args, gamma=gamma, lam=0.8, method="scan")
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)


@needs_compiler
def test_derivatives_are_the_scans():
    args = _batch(1, 3, 15, boundaries=False)

    def grads(method):
        def total(lam, values):
            return alg.gae(**{**args, "values": values}, gamma=0.95, lam=lam,
                           method=method)[0].sum()
        return jax.grad(total, argnums=(0, 1))(0.8, args["values"])

    for got, want in zip(grads("native"), grads("scan")):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert np.any(np.asarray(got) != 0)


@needs_compiler
@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_batches(shape):
    empty = np.zeros(shape, np.float32)
    advantages, returns = alg.gae(empty, empty, empty > 0, bootstrap_value=np.ones(
        shape[:1], np.float32), method="native")
    assert advantages.shape == returns.shape == shape


def test_float64_inputs_use_the_scan_and_native_names_the_dtype():
    with jax.enable_x64(True):
        args = {k: np.asarray(v, np.float64) if v.dtype == np.float32 else v
                for k, v in _batch(2, 2, 5, boundaries=False).items()}
        assert advantages_lib._resolve_method("auto", jnp.float64) == "scan"
        advantages, _ = alg.gae(**args, gamma=0.9, lam=0.9)
        assert advantages.dtype == jnp.float64
        with pytest.raises(ValueError, match=r"method='native' takes float32 inputs"):
            alg.gae(**args, gamma=0.9, lam=0.9, method="native")


def test_failed_build_warns_once_and_auto_falls_back_to_the_scan(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("ARL_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.warns(RuntimeWarning, match=r"'gae' kernel is unavailable.*`false .*failed"):
        assert not native.available("gae")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once per process, not at every call
        assert not native.available("gae")
        assert advantages_lib._resolve_method("auto") == "scan"
    with pytest.raises(RuntimeError, match=r"method='native' needs the C\+\+ kernel"):
        alg.gae(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32),
                np.ones((1, 2), bool), method="native")
    assert not list(tmp_path.glob("*.so"))  # nothing partial left in the cache


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("ARL_NATIVE", "0")
    assert not native.available("gae")
    assert advantages_lib._resolve_method("auto") == "scan"


def test_unknown_library_is_named():
    with pytest.raises(ValueError, match=r"unknown library 'scan'; allowed values: 'gae'"):
        native.available("scan")


@needs_compiler
def test_a_second_process_loads_the_cached_build(tmp_path):
    program = ("import os, sys; from arl import native; assert native.available('gae'); "
               "print(sorted(os.listdir(os.environ['ARL_NATIVE_CACHE'])))")
    env = dict(os.environ, ARL_NATIVE_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
    first = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                           text=True, check=True).stdout
    built = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.so")}
    assert len(built) == 1 and next(iter(built)) in first
    subprocess.run([sys.executable, "-c", program], env=env, check=True,
                   capture_output=True)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.so")} == built

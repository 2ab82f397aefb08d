"""`arl.models.activations.swiglu`: silu(gate) * up with a hand-written backward pass,
against float64 NumPy (values and derivatives) and autodiff of the plain formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from arl.models.activations import swiglu


def _numpy_swiglu_and_grads(g, u, c):
    """h = g s(g) u and the cotangents c dh/dg, c dh/du, float64, from the definition
    (s(g) = 1 / (1 + e^-g), s' = s (1 - s))."""
    g, u, c = (np.asarray(x, np.float64) for x in (g, u, c))
    s = 1.0 / (1.0 + np.exp(-g))
    return g * s * u, c * u * (s + g * s * (1.0 - s)), c * g * s


def _inputs(shape, seed=0, scale=3.0):
    kg, ku, kc = jax.random.split(jax.random.key(seed), 3)
    return tuple(scale * jax.random.normal(k, shape) for k in (kg, ku, kc))


def test_values_and_gradients_equal_the_numpy_reference():
    g, u, c = _inputs((64, 48))
    h, vjp = jax.vjp(jax.jit(swiglu), g, u)
    d_gate, d_up = vjp(c)
    want_h, want_dg, want_du = _numpy_swiglu_and_grads(g, u, c)
    np.testing.assert_allclose(h, want_h, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(d_gate, want_dg, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(d_up, want_du, rtol=2e-6, atol=1e-6)


def test_gradients_equal_autodiff_of_the_plain_formula_under_vmap():
    g, u, c = _inputs((4, 16, 8), seed=1)
    plain = lambda g, u: jax.nn.silu(g) * u
    ours = jax.vmap(jax.grad(lambda g, u, c: jnp.sum(swiglu(g, u) * c), argnums=(0, 1)))
    theirs = jax.vmap(jax.grad(lambda g, u, c: jnp.sum(plain(g, u) * c), argnums=(0, 1)))
    for got, want in zip(ours(g, u, c), theirs(g, u, c)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtype_is_kept(dtype):
    g, u, c = (x.astype(dtype) for x in _inputs((8, 8), seed=2))
    h, vjp = jax.vjp(swiglu, g, u)
    assert h.dtype == dtype and all(d.dtype == dtype for d in vjp(c))


@settings(max_examples=25, deadline=None)
@given(st.floats(-80.0, 80.0, width=32), st.floats(-10.0, 10.0, width=32))
def test_finite_and_exact_at_saturation(gate, up):
    """No NaN where the sigmoid saturates (e^-g overflows for g << 0)."""
    g, u = jnp.asarray([gate], jnp.float32), jnp.asarray([up], jnp.float32)
    h, vjp = jax.vjp(swiglu, g, u)
    d_gate, d_up = vjp(jnp.ones_like(g))
    want = _numpy_swiglu_and_grads(g, u, np.ones(1))
    for got, ref in zip((h, d_gate, d_up), want):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_is_rounded_once():
    """In bfloat16 the float32 arithmetic rounds once, at the end: closer to the float64
    values than the plain formula, which rounds after the sigmoid, silu and product."""
    g, u, _ = _inputs((256, 64), seed=3)
    g, u = g.astype(jnp.bfloat16), u.astype(jnp.bfloat16)
    want, _, _ = _numpy_swiglu_and_grads(g.astype(jnp.float32), u.astype(jnp.float32),
                                         np.ones(1))
    ours = np.asarray(swiglu(g, u), np.float64)
    plain = np.asarray(jax.nn.silu(g) * u, np.float64)
    # Rounding once to bfloat16 is within half an ulp (2^-8 relative).
    np.testing.assert_allclose(ours, want, rtol=2.0 ** -8, atol=1e-30)
    assert np.mean(np.abs(ours - want)) < np.mean(np.abs(plain - want))

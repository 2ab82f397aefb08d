"""Recorded projection outputs (`Transformer(..., return_projections=True)`, a cache with
`record_projections`) and their reuse as forward values (`projections=`,
`arl.models.projections.stored_linear`): the op differentiates as the projection, a
cached call records what a cache-free call computes, and a forward pass on its own
recorded outputs gives the same outputs and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.models import Transformer, init_cache
from arl.models.projections import LAYER_PROJECTIONS, stored_linear
from arl.models.transformer import per_layer_params, projection_features
from tests.models.helpers import SMALL, make

B, S = 3, 12
TOKENS = jax.random.randint(jax.random.key(5), (B, S), 0, SMALL.vocab_size)
BIASED = dataclasses.replace(SMALL, qkv_bias=True, o_bias=True, mlp_bias=True)
VARIANTS = {
    "plain": {},
    "biases": dict(qkv_bias=True, o_bias=True, mlp_bias=True),
    "scanned_remat": dict(layer_unroll=1, remat=True),
    "blocked": dict(attention="blocked", attention_block=4),
}


def _perturbed(params, seed=9):
    """Parameters with nonzero biases (the fresh ones are zero)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                     for x, k in zip(leaves, keys)])


def _model(variant):
    cfg = dataclasses.replace(SMALL, **VARIANTS[variant])
    _, _, params = make(BIASED if cfg.qkv_bias else SMALL)
    return Transformer(cfg), _perturbed(params)


@pytest.mark.parametrize("input_axes, bias, dtype", [
    (1, True, jnp.float32), (2, True, jnp.float32), (1, False, jnp.float32),
    (1, True, jnp.bfloat16)])
def test_stored_linear_is_the_projection_at_the_stored_value(input_axes, bias, dtype):
    """Forward: the stored array itself. Gradients with respect to x, the kernel and the
    bias: those of x @ kernel + bias (hand formulas dy W^T, x^T dy, sum dy, checked against
    autodiff of the plain projection) at the same cotangent; none flow into `stored`."""
    keys = jax.random.split(jax.random.key(0), 5)
    in_shape = (4,) if input_axes == 1 else (2, 3)
    x = jax.random.normal(keys[0], (5,) + in_shape, dtype)
    kernel = jax.random.normal(keys[1], in_shape + (2, 3), dtype)
    b = jax.random.normal(keys[2], (2, 3), dtype) if bias else None
    cotangent = jax.random.normal(keys[3], (5, 2, 3), dtype)
    contract = tuple(range(1, 1 + input_axes))

    def plain(x, kernel, b):
        y = jax.lax.dot_general(x, kernel, ((contract, tuple(range(input_axes))), ((), ())))
        return y if b is None else y + b

    stored = jax.random.normal(keys[4], (5, 2, 3), dtype)  # any value: it is returned
    out, vjp = jax.vjp(lambda *a: stored_linear(input_axes, *a), x, kernel, b, stored)
    np.testing.assert_array_equal(out, stored)
    dx, dk, db, d_stored = vjp(cotangent)
    _, plain_vjp = jax.vjp(plain, x, kernel, b)
    want = plain_vjp(cotangent)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for got, expected, name in zip((dx, dk, db), want, ("x", "kernel", "bias")):
        if expected is None:
            assert got is None
            continue
        assert got.dtype == dtype and got.shape == expected.shape, name
        np.testing.assert_allclose(np.asarray(got, np.float32),
                                   np.asarray(expected, np.float32), err_msg=name, **tol)
    flat_x = np.asarray(x, np.float64).reshape(5, -1)
    flat_dy = np.asarray(cotangent, np.float64).reshape(5, -1)
    np.testing.assert_allclose(np.asarray(dk, np.float64).reshape(flat_x.shape[1], -1),
                               flat_x.T @ flat_dy, **tol)  # x^T dy by hand
    np.testing.assert_array_equal(d_stored, np.zeros_like(d_stored))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_forward_on_its_own_projections_is_the_forward(variant):
    """Outputs bit for bit (the stored values are the ones the projections computed), and
    the gradients of a loss over logits and values equal plain autodiff's up to float
    summation order."""
    model, params = _model(variant)
    plain = jax.jit(lambda p: model.apply({"params": p}, TOKENS, return_projections=True))
    out = plain(params)
    assert set(out.projections) == set(LAYER_PROJECTIONS)
    for name, features in projection_features(model.config).items():
        assert out.projections[name].shape == (SMALL.num_layers, B, S) + features
    reused = jax.jit(lambda p, r: model.apply({"params": p}, TOKENS, projections=r))(
        params, out.projections)
    np.testing.assert_array_equal(reused.logits, out.logits)
    np.testing.assert_array_equal(reused.values, out.values)

    weights = jax.random.normal(jax.random.key(6), (B, S))

    def loss(p, recorded):
        o = model.apply({"params": p}, TOKENS, projections=recorded)
        return (jnp.sum(jax.nn.log_softmax(o.logits)[..., 1] * weights)
                + jnp.sum(o.values * weights))

    grad = jax.jit(jax.grad(loss))
    g_plain, g_reused = grad(params, None), grad(params, out.projections)
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(g_plain)[0],
                                 jax.tree.leaves(g_reused)):
        assert np.max(np.abs(want)) > 0, path
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.max(np.abs(want)),
                                   err_msg=jax.tree_util.keystr(path))


def test_stored_values_are_the_forward_values():
    """The projections' outputs are taken, not recomputed: scaling the stored MLP outputs
    changes the logits (a forward that recomputed them would not move)."""
    model, params = _model("plain")
    out = model.apply({"params": params}, TOKENS, return_projections=True)
    changed = {**out.projections, "down_proj": 3.0 * out.projections["down_proj"]}
    moved = model.apply({"params": params}, TOKENS, projections=changed)
    assert np.max(np.abs(moved.logits - out.logits)) > 1e-3


# -m slow: tests/test_reuse_activations.py checks the same on a multi-turn rollout.
@pytest.mark.slow
@pytest.mark.parametrize("per_layer", [False, True])
def test_cached_calls_record_what_a_cache_free_call_computes(per_layer):
    """A padded prefill (rows of 5, 3 and 0 valid tokens) then two decoded tokens, on a
    recording cache: the buffers hold the cache-free call's projection outputs at every
    written slot and zeros everywhere else (padding and idle rows write nothing), on the
    stacked and on the per-layer cache."""
    cfg = dataclasses.replace(SMALL, layer_unroll=SMALL.num_layers if per_layer else 1)
    model = Transformer(cfg)
    _, _, params = make(SMALL)
    apply_params = per_layer_params(params) if per_layer else params
    cache = init_cache(cfg, B, S, record_projections=True)
    if per_layer:
        cache = cache.per_layer()
    num_valid = jnp.array([5, 3, 0], jnp.int32)
    out = model.apply({"params": apply_params}, TOKENS[:, :5], cache,
                      num_valid=num_valid, method="decode")
    for step in range(2):
        token = TOKENS[jnp.arange(B), out.cache.length][:, None]
        out = model.apply({"params": apply_params}, token, out.cache,
                          num_valid=jnp.array([1, 1, 0], jnp.int32), method="decode")
    length = np.asarray(out.cache.length)
    np.testing.assert_array_equal(length, [7, 5, 0])
    full = model.apply({"params": params}, TOKENS, return_projections=True).projections
    written = np.arange(S)[None, :] < length[:, None]  # [B, S]
    for name, recorded in out.cache.projections.items():
        recorded, want = np.asarray(recorded), np.asarray(full[name])
        np.testing.assert_allclose(recorded[:, written], want[:, written], rtol=1e-5,
                                   atol=1e-5, err_msg=name)
        assert not np.any(recorded[:, ~written]), name

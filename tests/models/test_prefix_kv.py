"""A sequence computed in two differentiable parts (`Transformer(..., return_kv=True)`, then
`prefix_kv=`) equals the whole sequence computed at once: hidden states, logits, values,
the returned keys and values, and gradients through both parts, for dense and blocked
attention, stacked or rematerialised layers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.models import KVCache, Transformer
from tests.models.helpers import SMALL, make

B, S, P = 3, 21, 8
TOKENS = jax.random.randint(jax.random.key(3), (B, S), 0, SMALL.vocab_size)
VARIANTS = {
    "dense": dict(attention="dense"),
    "blocked": dict(attention="blocked", attention_block=4),  # blocks straddle the prefix
    "blocked_remat_unrolled": dict(attention="blocked", attention_block=8, remat=True,
                                   layer_unroll=2),
}


def _model(variant):
    cfg = dataclasses.replace(SMALL, **VARIANTS[variant])
    _, _, params = make(SMALL)  # the same parameters for every variant
    return Transformer(cfg), params


def _two_parts(model, params, tokens, prefix_len):
    first = model.apply({"params": params}, tokens[:, :prefix_len], return_kv=True)
    rest = model.apply({"params": params}, tokens[:, prefix_len:], prefix_kv=first.cache,
                       return_kv=True)
    return first, rest


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_parts_equal_the_whole_sequence(variant):
    model, params = _model(variant)
    whole = jax.jit(lambda p, t: model.apply({"params": p}, t, return_kv=True))(params, TOKENS)
    first, rest = jax.jit(lambda p, t: _two_parts(model, p, t, P))(params, TOKENS)
    for name in ("logits", "values"):
        got = jnp.concatenate([getattr(first, name), getattr(rest, name)], axis=1)
        np.testing.assert_allclose(got, getattr(whole, name), rtol=2e-5, atol=2e-5,
                                   err_msg=name)
    assert whole.cache.keys.shape == (SMALL.num_layers, B, S, SMALL.num_kv_heads,
                                      SMALL.resolved_head_dim)
    np.testing.assert_array_equal(whole.cache.length, [S] * B)
    for name in ("keys", "values"):
        got = jnp.concatenate([getattr(first.cache, name), getattr(rest.cache, name)], axis=2)
        np.testing.assert_allclose(got, getattr(whole.cache, name), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradients_flow_through_the_prefix(variant):
    """A loss on the second part's outputs only: its gradient through the prefix's keys
    and values matches the whole sequence's (and is not zero in the first part)."""
    model, params = _model(variant)
    weights = jax.random.normal(jax.random.key(4), (B, S - P, SMALL.vocab_size))

    def loss_parts(p):
        _, rest = _two_parts(model, p, TOKENS, P)
        return jnp.sum(rest.logits * weights) + jnp.sum(rest.values)

    def loss_whole(p):
        out = model.apply({"params": p}, TOKENS)
        return jnp.sum(out.logits[:, P:] * weights) + jnp.sum(out.values[:, P:])

    got = jax.jit(jax.grad(loss_parts))(params)
    want = jax.jit(jax.grad(loss_whole))(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_prefix_errors():
    model, params = _model("dense")
    first = model.apply({"params": params}, TOKENS[:, :P], return_kv=True)
    call = lambda **kw: model.apply({"params": params}, TOKENS[:, P:], **kw)  # noqa: E731
    with pytest.raises(ValueError, match="stacked KVCache"):
        call(prefix_kv=first.cache.per_layer())
    with pytest.raises(ValueError, match=r"\[L, B, P, KV, Dh\]"):
        call(prefix_kv=KVCache(keys=first.cache.keys[:, :2], values=first.cache.values[:, :2],
                               length=first.cache.length[:2]))
    with pytest.raises(ValueError, match="positions or attention_mask"):
        call(prefix_kv=first.cache, attention_mask=jnp.ones((B, S - P), jnp.int32))

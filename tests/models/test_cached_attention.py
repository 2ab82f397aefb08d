"""Cached (decoding) attention over the filled blocks of the KV cache
(`arl.models.attention_kernels.cached_attention`): against a float64 NumPy reference, never
reading past the last query's block, and through `Transformer` and `generate` against
the dense cached path."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.models import Transformer, generate, init_cache
from arl.models import attention_kernels as attention_lib
from arl.models.attention_kernels import cached_attention
from tests.models.helpers import SMALL, make

LAYERS, BATCH, CAPACITY, KV, DIM = 2, 3, 20, 2, 8


def _numpy_cached_attention(q, keys, values, layer, slots):
    """out[b, t, h] = sum_{s <= slots[b, t]} softmax(q . k[layer, b, s] / sqrt(d)) v,
    float64."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    batch, length, heads, dim = q.shape
    groups = heads // keys.shape[3]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(length):
            seen = slice(0, min(int(slots[b, t]), keys.shape[2] - 1) + 1)
            for h in range(heads):
                z = keys[layer, b, seen, h // groups] @ q[b, t, h] / math.sqrt(dim)
                p = np.exp(z - z.max())
                out[b, t, h] = (p / p.sum()) @ values[layer, b, seen, h // groups]
    return out


def _cache_and_queries(heads=4, q_len=3, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shape = (LAYERS, BATCH, CAPACITY, KV, DIM)
    q = jax.random.normal(kq, (BATCH, q_len, heads, DIM))
    # Row 0 early in the cache, row 1 at its end (the clamped last block), row 2 at slot 0.
    slots = np.array([[4, 5, 6], [17, 18, 19], [0, 1, 2]])[:, :q_len]
    return q, jax.random.normal(kk, shape), jax.random.normal(kv, shape), slots


@pytest.mark.parametrize("block_size", [1, 5, 8, 32])
@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize("q_len", [1, 3])
def test_equals_the_numpy_reference(block_size, heads, q_len):
    """Blocks of 8 over 20 slots: the third block is clamped to slots 12-19 and slots
    12-15, already seen, are masked in it. One query per row takes the head-pair products
    on the CPU."""
    q, keys, values, slots = _cache_and_queries(heads, q_len)
    attend = jax.jit(lambda q, k, v, layer, s: cached_attention(q, k, v, layer, s,
                                                                block_size=block_size))
    for layer in range(LAYERS):
        got = attend(q, keys, values, layer, jnp.asarray(slots))
        np.testing.assert_allclose(got, _numpy_cached_attention(q, keys, values, layer, slots),
                                   atol=2e-6, rtol=1e-5)


def _one_layer(keys, values, layer):
    """Layer `layer` of the stacked cache as a per-layer cache holds it: keys [B, KV, d,
    S], values [B, KV, S, d] (`KVCache.per_layer`)."""
    return keys[layer].transpose(0, 2, 3, 1), values[layer].transpose(0, 2, 1, 3)


@pytest.mark.parametrize("block_size", [1, 8, 32])
@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize("q_len", [1, 3])
def test_one_layer_of_a_per_layer_cache_equals_the_numpy_reference(block_size, heads, q_len):
    """The same attention read from one layer's buffers (layer_index None), in the layout
    of a per-layer cache."""
    q, keys, values, slots = _cache_and_queries(heads, q_len)
    attend = jax.jit(lambda q, k, v, s: cached_attention(q, k, v, None, s,
                                                         block_size=block_size))
    for layer in range(LAYERS):
        got = attend(q, *_one_layer(keys, values, layer), jnp.asarray(slots))
        np.testing.assert_allclose(got, _numpy_cached_attention(q, keys, values, layer, slots),
                                   atol=2e-6, rtol=1e-5)


def test_one_layer_blocks_past_the_last_query_are_never_read():
    q, keys, values, slots = _cache_and_queries(q_len=1)
    slots = np.minimum(slots, 6)
    poisoned = [x.at[:, :, 8:].set(jnp.nan) for x in (keys, values)]
    got = cached_attention(q, *_one_layer(*poisoned, 1), None, jnp.asarray(slots),
                           block_size=8)
    np.testing.assert_allclose(got, _numpy_cached_attention(q, keys, values, 1, slots),
                               atol=2e-6, rtol=1e-5)


def test_one_layer_in_the_stacked_layout_is_named():
    q, keys, values, slots = _cache_and_queries()
    with pytest.raises(ValueError, match=r"keys \[B=3, KV, d=8, S\] and values \[B, KV, S, d\]"):
        cached_attention(q, keys[0], values[0], None, jnp.asarray(slots), block_size=8)


@pytest.mark.parametrize("q_len", [1, 3])
def test_blocks_past_the_last_query_are_never_read(q_len):
    """NaN in every slot past the block of the largest query slot (6, block 0 of 8
    slots): the result stays finite and equal to the reference, so those blocks were
    skipped, not masked (a masked NaN value would still poison p @ v)."""
    q, keys, values, slots = _cache_and_queries(q_len=q_len)
    slots = np.minimum(slots, 6)
    poisoned = [x.at[:, :, 8:].set(jnp.nan) for x in (keys, values)]
    got = cached_attention(q, *poisoned, 1, jnp.asarray(slots), block_size=8)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _numpy_cached_attention(q, keys, values, 1, slots),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("q_len", [1, 3])
def test_bfloat16_is_close_to_float32(q_len):
    q, keys, values, slots = _cache_and_queries(q_len=q_len)
    full = cached_attention(q, keys, values, 0, jnp.asarray(slots), block_size=8)
    half = cached_attention(q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                            values.astype(jnp.bfloat16), 0, jnp.asarray(slots), block_size=8)
    assert half.dtype == jnp.bfloat16
    # Measured error 0.004-0.008 (seeds 0-2, both query lengths; mostly the inputs' and
    # the output's rounding to bfloat16): about two and a half times that.
    np.testing.assert_allclose(half.astype(jnp.float32), full, atol=0.02)


def test_arguments_are_checked():
    q, keys, values, slots = _cache_and_queries()
    with pytest.raises(ValueError, match="query_slots"):
        cached_attention(q, keys, values, 0, jnp.asarray(slots[:, :2]), block_size=8)
    with pytest.raises(ValueError, match="block_size"):
        cached_attention(q, keys, values, 0, jnp.asarray(slots), block_size=0)
    with pytest.raises(ValueError, match="divide"):
        cached_attention(q[:, :, :3], keys, values, 0, jnp.asarray(slots), block_size=8)


# Cache capacity 32 > attention_block 8: "auto" resolves cached calls to the blocked path.
AUTO_SMALL_BLOCKS = dataclasses.replace(SMALL, attention_block=8)


@pytest.mark.parametrize("padded", [False, True])
def test_transformer_decoding_equals_the_dense_cached_path(padded):
    """Prefill (left-padded rows through attention_mask, or num_valid) then 12 decoded
    tokens: logits, values and the cache equal the dense path's at every call."""
    _, _, params = make(SMALL)
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, SMALL.vocab_size)
    if padded:
        mask = np.ones((3, 9), bool)
        mask[0, :4] = False
        mask[2, :1] = False
        prefill = dict(attention_mask=jnp.asarray(mask))
    else:
        prefill = dict(num_valid=jnp.asarray([9, 3, 6], jnp.int32))
    steps = jax.random.randint(jax.random.key(2), (12, 3, 1), 0, SMALL.vocab_size)

    def run(config):
        model = Transformer(config)

        # The decoding calls in a scan, not unrolled: one compiled decode step instead
        # of twelve (the suite's time is compiling); each call's output is kept.
        @jax.jit
        def decode(params):
            cache = init_cache(config, 3, 32)
            out = model.apply({"params": params}, tokens, cache, **prefill, method="decode")

            def step(cache, token):
                out = model.apply({"params": params}, token, cache, method="decode")
                return out.cache, out

            _, outs = jax.lax.scan(step, out.cache, steps)
            return [out] + [jax.tree.map(lambda x: x[i], outs) for i in range(len(steps))]
        return decode(params)

    real = np.ones((3, 9), bool) if not padded else mask  # padding queries: meaningless
    calls = list(zip(run(AUTO_SMALL_BLOCKS), run(SMALL)))
    assert len(calls) == 13
    for call, (blocked, dense) in enumerate(calls):
        seen = real if call == 0 else np.ones((3, 1), bool)
        np.testing.assert_allclose(blocked.logits * seen[..., None],
                                   dense.logits * seen[..., None], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(blocked.values * seen, dense.values * seen, atol=1e-5)
        np.testing.assert_array_equal(blocked.cache.length, dense.cache.length)
        np.testing.assert_allclose(blocked.cache.keys, dense.cache.keys, atol=1e-5)


def test_an_empty_call_leaves_the_cache_as_it_is():
    """A call with no tokens (the reply of an env without observations, [B, 0]) on the
    blocked path: empty logits, the cache unchanged (it crashed on an empty max before)."""
    _, _, params = make(SMALL)
    model = Transformer(AUTO_SMALL_BLOCKS)
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, SMALL.vocab_size)
    cache = jax.jit(lambda p: model.apply(  # one program, not the model op by op
        {"params": p}, tokens, init_cache(AUTO_SMALL_BLOCKS, 3, 32),
        num_valid=jnp.asarray([9, 3, 6], jnp.int32), method="decode").cache)(params)
    out = jax.jit(lambda p, c: model.apply({"params": p}, jnp.zeros((3, 0), jnp.int32), c,
                                           num_valid=jnp.zeros((3,), jnp.int32),
                                           method="decode"))(params, cache)
    assert out.logits.shape == (3, 0, SMALL.vocab_size)
    np.testing.assert_array_equal(out.cache.length, [9, 3, 6])
    np.testing.assert_array_equal(out.cache.keys, cache.keys)
    np.testing.assert_array_equal(out.cache.values, cache.values)


@pytest.mark.parametrize("stop_early", [False, True])
def test_sampled_generation_is_unchanged(stop_early):
    """`generate` after a ragged prefill: the same tokens (sampled at temperature 0.7,
    same key) and log-probs as with the dense cached attention."""
    _, _, params = make(SMALL)
    prompt = jax.random.randint(jax.random.key(3), (4, 5), 0, SMALL.vocab_size)
    num_valid = jnp.asarray([5, 2, 4, 1], jnp.int32)

    def run(config):
        model = Transformer(config)

        @jax.jit
        def sample(params):
            out = model.apply({"params": params}, prompt, init_cache(config, 4, 32),
                              num_valid=num_valid, method="decode")
            last = jnp.take_along_axis(out.logits, (num_valid - 1)[:, None, None],
                                       axis=1)[:, 0]
            return generate(model, params, out.cache, last, jax.random.key(4),
                            max_new_tokens=20, eot_id=SMALL.vocab_size - 1, pad_id=0,
                            temperature=0.7, stop_early=stop_early)
        return sample(params)

    blocked, dense = run(AUTO_SMALL_BLOCKS), run(SMALL)
    np.testing.assert_array_equal(blocked.tokens, dense.tokens)
    np.testing.assert_allclose(blocked.logp, dense.logp, atol=1e-5)


# ------------------------------------------- single-token decoding: products over head pairs


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("num_kv,groups", [(1, 1), (1, 4), (2, 3), (4, 2), (8, 1)])
def test_head_pair_products_equal_the_grouped_einsums(q_len, num_kv, groups):
    """scores [B, KV, G, T, S] and the mix [B, T, KV, G, d] against float64 NumPy einsums,
    for the cache layout [B, S, KV, d]."""
    rng = np.random.default_rng(num_kv * 10 + groups + q_len)
    batch, slots, dim = 3, 11, 8
    q = rng.normal(size=(batch, q_len, num_kv, groups, dim)).astype(np.float32)
    keys, values = (rng.normal(size=(batch, slots, num_kv, dim)).astype(np.float32)
                    for _ in range(2))
    probs = rng.random(size=(batch, num_kv, groups, q_len, slots)).astype(np.float32)
    scores = jax.jit(attention_lib.scores_every_head_pair)(q, keys)
    mixed = jax.jit(attention_lib.mix_every_head_pair)(probs, values)
    assert scores.dtype == jnp.float32 and mixed.dtype == jnp.float32
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    np.testing.assert_allclose(scores, np.einsum("btkgd,bskd->bkgts", f64(q), f64(keys)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mixed, np.einsum("bkgts,bskd->btkgd", f64(probs), f64(values)),
                               rtol=1e-5, atol=1e-5)


def test_head_pair_products_in_bfloat16():
    """bfloat16 cache: float32 scores; the mix in bfloat16, as the einsum's."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(2, 1, 2, 3, 16)), jnp.bfloat16)
    keys, values = (jnp.asarray(rng.normal(size=(2, 9, 2, 16)), jnp.bfloat16) for _ in range(2))
    probs = jax.nn.softmax(attention_lib.scores_every_head_pair(q, keys), -1)
    want = jax.nn.softmax(jnp.einsum("btkgd,bskd->bkgts", q, keys,
                                     preferred_element_type=jnp.float32), -1)
    assert probs.dtype == jnp.float32
    np.testing.assert_allclose(probs, want, rtol=1e-5, atol=1e-6)
    mixed = attention_lib.mix_every_head_pair(probs.astype(jnp.bfloat16), values)
    assert mixed.dtype == jnp.bfloat16
    accumulated = attention_lib.mix_every_head_pair(probs.astype(jnp.bfloat16), values,
                                                    preferred_element_type=jnp.float32)
    assert accumulated.dtype == jnp.float32
    np.testing.assert_allclose(
        accumulated, jnp.einsum("bkgts,bskd->btkgd", probs.astype(jnp.bfloat16), values,
                                preferred_element_type=jnp.float32), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        mixed.astype(np.float32),
        jnp.einsum("bkgts,bskd->btkgd", probs.astype(jnp.bfloat16), values).astype(np.float32),
        rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="head pairs are the CPU path")
def test_decoding_through_head_pairs_equals_the_grouped_einsums(monkeypatch):
    """The model decodes single tokens through the head-pair products on the CPU: the
    same logits (to float32 rounding) and the same sampled tokens as through the grouped
    einsums (the previous path, `uses_head_pairs` patched to False)."""
    _, _, params = make(SMALL)
    model = Transformer(SMALL)
    prompt = jax.random.randint(jax.random.key(3), (4, 5), 0, SMALL.vocab_size)
    num_valid = jnp.asarray([5, 2, 4, 1], jnp.int32)

    def run():
        def sample(params):
            out = model.apply({"params": params}, prompt, init_cache(SMALL, 4, 32),
                              num_valid=num_valid, method="decode")
            last = jnp.take_along_axis(out.logits, (num_valid - 1)[:, None, None],
                                       axis=1)[:, 0]
            step = model.apply({"params": params}, prompt[:, :1], out.cache, method="decode")
            return step.logits, generate(model, params, out.cache, last, jax.random.key(4),
                                         max_new_tokens=20, eot_id=SMALL.vocab_size - 1,
                                         pad_id=0, temperature=0.7)
        return str(jax.make_jaxpr(sample)(params)), jax.jit(sample)(params)

    pairs_program, (pairs_logits, pairs) = run()
    monkeypatch.setattr(attention_lib, "uses_head_pairs", lambda q_len: False)
    einsum_program, (einsum_logits, einsums) = run()
    assert pairs_program != einsum_program  # two paths, not one traced twice
    np.testing.assert_allclose(pairs_logits, einsum_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pairs.tokens, einsums.tokens)
    np.testing.assert_allclose(pairs.logp, einsums.logp, atol=1e-5)

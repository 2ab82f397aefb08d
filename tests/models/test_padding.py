"""Explicit positions and padding masks: a padded row (left, right or interior padding)
scores like the same row without padding, with and without the KV cache; the cache keeps
only real tokens, so generation after a left-padded prefill equals generation after an
unpadded one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.models import generate, init_cache
from arl.models.chunked_logprobs import model_token_logprobs
from tests.models.helpers import SMALL, jitted_forward, make

PAD = 0
# Three rows of real tokens, padded in different places (1 = real token).
ROWS = [[5, 9, 2, 7, 1], [3, 8, 4], [6, 2, 11, 13]]
MASK = np.array([[1, 1, 1, 1, 1, 0],    # right padding
                 [0, 0, 0, 1, 1, 1],    # left padding (HF batched generation)
                 [0, 1, 1, 0, 1, 1]],   # interior padding
                np.int32)


def _padded(rows, mask):
    tokens = np.full(mask.shape, PAD, np.int32)
    for b, row in enumerate(rows):
        tokens[b, np.flatnonzero(mask[b])] = row
    return tokens


TOKENS = _padded(ROWS, MASK)


@functools.lru_cache(maxsize=None)
def _forward(with_positions=False):
    model, _, _ = make(SMALL)
    if with_positions:
        return jax.jit(lambda p, t, m, pos: model.apply({"params": p}, t, attention_mask=m,
                                                        positions=pos, return_hidden=True))
    return jax.jit(lambda p, t, m: model.apply({"params": p}, t, attention_mask=m,
                                               return_hidden=True))


def _unpadded(params, row):
    return jitted_forward(SMALL)(params, jnp.asarray([row], jnp.int32))


def test_padded_rows_score_like_unpadded_rows():
    _, _, params = make(SMALL)
    out = _forward()(params, TOKENS, MASK)
    assert np.isfinite(out.logits).all() and np.isfinite(out.values).all()
    for b, row in enumerate(ROWS):
        real = np.flatnonzero(MASK[b])
        ref = _unpadded(params, row)
        np.testing.assert_allclose(out.logits[b, real], ref.logits[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out.values[b, real], ref.values[0], atol=1e-5, rtol=1e-5)
    # A mask of ones is the plain forward.
    full = jitted_forward(SMALL)(params, TOKENS)
    ones = _forward()(params, TOKENS, np.ones_like(MASK))
    np.testing.assert_allclose(ones.logits, full.logits, atol=1e-6, rtol=1e-6)


def test_model_token_logprobs_of_padded_rows():
    model, _, params = make(SMALL)
    logp, ent = jax.jit(lambda p, t, m: model_token_logprobs(model, p, t, 4,
                                                             attention_mask=m))(
        params, TOKENS, MASK)
    for b, row in enumerate(ROWS[:2]):  # right and left padding: contiguous real tokens
        real = np.flatnonzero(MASK[b])[1:]  # the first real token has no real context
        ref_logp, ref_ent = model_token_logprobs(model, params, jnp.asarray([row]), 4)
        np.testing.assert_allclose(logp[b, real], ref_logp[0, 1:], atol=1e-5)
        np.testing.assert_allclose(ent[b, real], ref_ent[0, 1:], atol=1e-5)


def test_padding_tokens_are_never_attended():
    """Changing the ids under the padding changes no real position's output."""
    _, _, params = make(SMALL)
    other = np.where(MASK == 1, TOKENS, 17)
    a, b = _forward()(params, TOKENS, MASK), _forward()(params, other, MASK)
    real = MASK == 1
    np.testing.assert_array_equal(np.asarray(a.logits)[real], np.asarray(b.logits)[real])
    assert not np.allclose(a.logits[~real], b.logits[~real])  # the padding's own outputs


def test_explicit_positions_drive_rope_and_only_relative_positions_matter():
    _, _, params = make(SMALL)
    ones = np.ones_like(MASK)
    default = jitted_forward(SMALL)(params, TOKENS).logits
    arange = np.broadcast_to(np.arange(6, dtype=np.int32), TOKENS.shape)
    with_positions = _forward(with_positions=True)
    np.testing.assert_allclose(with_positions(params, TOKENS, ones, arange).logits, default,
                               atol=1e-6, rtol=1e-6)
    # RoPE scores depend on q - k only: shifting every position by a per-row constant
    # (e.g. Hugging Face's arange positions under left padding) keeps the outputs.
    shifted = arange + np.array([[3], [100], [7]], np.int32)
    np.testing.assert_allclose(with_positions(params, TOKENS, ones, shifted).logits, default,
                               atol=2e-4, rtol=2e-4)
    # Different relative positions change them.
    spread = arange * 2
    assert not np.allclose(with_positions(params, TOKENS, ones, spread).logits[:, 1:],
                           default[:, 1:], atol=1e-3)


# ----------------------------------------------------------------------------- KV cache

CAPACITY = 12
NEW_TOKENS = 4


@functools.lru_cache(maxsize=None)
def _prefill_generate(use_mask):
    """jit(params, tokens, mask_or_num_valid) -> (prefill output, greedy generation)."""
    model, _, _ = make(SMALL)

    def run(params, tokens, padding):
        cache = init_cache(SMALL, tokens.shape[0], CAPACITY)
        if use_mask:
            out = model.apply({"params": params}, tokens, cache, attention_mask=padding,
                              method="decode")
            last = out.logits[:, -1]  # left padding: the last slot is real
        else:
            out = model.apply({"params": params}, tokens, cache, num_valid=padding, method="decode")
            last = jnp.take_along_axis(out.logits, (padding - 1)[:, None, None], axis=1)[:, 0]
        gen = generate(model, params, out.cache, last, jax.random.key(0),
                       max_new_tokens=NEW_TOKENS, eot_id=-1, pad_id=PAD, greedy=True)
        return out, gen

    return jax.jit(run)


def test_left_padded_prefill_packs_real_tokens_and_generation_ignores_padding():
    _, _, params = make(SMALL)
    left = np.zeros_like(MASK)
    lengths = np.array([len(r) for r in ROWS])
    for b, n in enumerate(lengths):
        left[b, -n:] = 1
    tokens = _padded(ROWS, left)
    out, gen = _prefill_generate(True)(params, tokens, left)
    right = _padded(ROWS, (np.arange(6) < lengths[:, None]).astype(np.int32))
    ref_out, ref_gen = _prefill_generate(False)(params, right, jnp.asarray(lengths, jnp.int32))
    # The cache holds the real tokens only, packed from slot 0: what an unpadded prefill
    # writes.
    np.testing.assert_array_equal(out.cache.length, lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(out.cache.keys[:, b, :n], ref_out.cache.keys[:, b, :n],
                                   atol=1e-5)
        np.testing.assert_allclose(out.logits[b, -n:], ref_out.logits[b, :n], atol=1e-5)
    np.testing.assert_array_equal(gen.tokens, ref_gen.tokens)
    np.testing.assert_allclose(gen.logp, ref_gen.logp, atol=1e-5)
    np.testing.assert_array_equal(gen.cache.length, lengths + NEW_TOKENS)
    # ... and the continuation scores like one unpadded forward of prompt + generation.
    for b, row in enumerate(ROWS):
        full = _unpadded(params, row + gen.tokens[b].tolist()).logits[0]
        np.testing.assert_allclose(gen.last_logits[b], full[-1], atol=1e-5)
        picked = jax.nn.log_softmax(full[len(row) - 1:-1])[np.arange(NEW_TOKENS), gen.tokens[b]]
        np.testing.assert_allclose(gen.logp[b], picked, atol=1e-5)


def test_cache_chunks_with_interior_padding_and_an_all_padding_row():
    model, _, params = make(SMALL)
    step = jax.jit(lambda p, t, c, m: model.apply({"params": p}, t, c,
                                                  attention_mask=m, method="decode"))
    cache = init_cache(SMALL, 3, CAPACITY)
    first = step(params, TOKENS, cache, MASK)
    second_tokens = np.array([[21, 22], [23, 24], [25, 26]], np.int32)
    second_mask = np.array([[0, 1], [1, 1], [0, 0]], np.int32)  # row 2 receives nothing
    second = step(params, second_tokens, first.cache, second_mask)
    np.testing.assert_array_equal(first.cache.length, MASK.sum(1))
    np.testing.assert_array_equal(second.cache.length, MASK.sum(1) + second_mask.sum(1))
    np.testing.assert_array_equal(second.cache.keys[:, 2], first.cache.keys[:, 2])
    np.testing.assert_array_equal(second.cache.values[:, 2], first.cache.values[:, 2])
    for b, row in enumerate(ROWS):
        new = second_tokens[b][second_mask[b] == 1].tolist()
        ref = _unpadded(params, row + new).logits[0]
        np.testing.assert_allclose(first.logits[b, MASK[b] == 1], ref[:len(row)], atol=1e-5)
        np.testing.assert_allclose(second.logits[b, second_mask[b] == 1], ref[len(row):],
                                   atol=1e-5)


def test_explicit_positions_with_the_cache():
    """positions override the RoPE positions of a cached call; causality stays by slot."""
    model, _, params = make(SMALL)
    step = jax.jit(lambda p, t, c, pos: model.apply({"params": p}, t, c, positions=pos,
                                                    method="decode"))
    tokens = np.array([ROWS[0]], np.int32)
    cache = init_cache(SMALL, 1, CAPACITY)
    default = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, method="decode"))(
        params, tokens, cache)
    same = step(params, tokens, cache, np.arange(5, dtype=np.int32)[None])
    np.testing.assert_allclose(same.logits, default.logits, atol=1e-6)
    np.testing.assert_allclose(same.cache.keys, default.cache.keys, atol=1e-6)
    shifted = step(params, tokens, cache, np.arange(5, dtype=np.int32)[None] + 40)
    np.testing.assert_allclose(shifted.logits, default.logits, atol=2e-4, rtol=2e-4)
    assert not np.allclose(shifted.cache.keys[:, :, :5], default.cache.keys[:, :, :5])


def test_argument_errors_name_the_argument():
    model, _, params = make(SMALL)
    tokens = jnp.zeros((2, 4), jnp.int32)
    apply = lambda **kw: model.apply({"params": params}, tokens, **kw)
    with pytest.raises(ValueError, match="attention_mask must be a bool or integer array"):
        apply(attention_mask=jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        apply(attention_mask=jnp.ones((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="positions must be an integer array"):
        apply(positions=jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="positions"):
        apply(positions=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="either num_valid .* or attention_mask"):
        apply(cache=init_cache(SMALL, 2, 8), num_valid=jnp.ones(2, jnp.int32),
              attention_mask=jnp.ones((2, 4), bool), method="decode")

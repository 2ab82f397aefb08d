"""Sampling inside jit: truncation sets, greedy/temperature, generate vs full recomputation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from arl.models import (generate, init_cache, sample_from_logits, take_last_valid,
                        truncation_mask)
from arl.models.sampling import first_argmax
from tests.models.helpers import SMALL, jitted_forward, log_softmax_at, make

# ----------------------------------------------------------------------------- sample_from_logits

LOGITS = jnp.array([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                    [0.1, 0.0, 3.0, 0.2, 2.9, -1.0, 1.0, 0.3]])


@functools.lru_cache(maxsize=None)
def _draw_fn(top_k, greedy):
    draw = lambda key, t, p: sample_from_logits(key, LOGITS, temperature=t, top_k=top_k,
                                                top_p=p, greedy=greedy)
    return jax.jit(jax.vmap(draw, in_axes=(0, None, None)))


def _draw_many(num, top_k=0, greedy=False, temperature=1.0, top_p=1.0):
    """`num` independent draws; temperature and top_p are traced (one compile per top_k)."""
    keys = jax.random.split(jax.random.key(0), num)
    out = _draw_fn(top_k, greedy)(keys, jnp.float32(temperature), jnp.float32(top_p))
    return jax.tree.map(np.asarray, out)


def _nucleus_reference(logits, top_k, top_p):
    """Plain NumPy top-k then top-p allowed sets (float64)."""
    allowed = []
    for row in np.asarray(logits, np.float64):
        order = np.argsort(-row, kind="stable")
        if top_k:
            order = order[:top_k]
        probs = np.exp(row[order] - row[order].max())
        probs /= probs.sum()
        mass_before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        allowed.append(set(order[mass_before < top_p].tolist()))
    return allowed


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.6), (4, 0.5)])
def test_top_k_top_p_never_sample_outside_the_allowed_set(top_k, top_p):
    tokens, logp = _draw_many(3000, top_k=top_k, top_p=top_p)
    allowed = _nucleus_reference(LOGITS, top_k, top_p)
    for b in range(LOGITS.shape[0]):
        seen = set(tokens[:, b].tolist())
        assert seen <= allowed[b]
        assert seen == allowed[b]  # every allowed token shows up in 3000 draws
    # logp is the untruncated log-softmax at the drawn token.
    full = np.asarray(jax.nn.log_softmax(LOGITS, -1))
    np.testing.assert_allclose(logp, full[np.arange(2), tokens], rtol=1e-6)


def test_unrestricted_sampling_frequencies_match_softmax():
    tokens, _ = _draw_many(20000, temperature=2.0)
    probs = np.asarray(jax.nn.softmax(LOGITS / 2.0, -1))
    for b in range(2):
        freq = np.bincount(tokens[:, b], minlength=8) / len(tokens)
        np.testing.assert_allclose(freq, probs[b], atol=0.015)


@functools.lru_cache(maxsize=None)
def _jitted_mask(top_k):
    return jax.jit(lambda logits, top_p: truncation_mask(logits, top_k=top_k, top_p=top_p))


@settings(max_examples=40, deadline=None)
# No subnormals: XLA on CPU flushes them to zero, NumPy does not, which fakes tie mismatches.
@given(logits=st.lists(st.floats(-5, 5, allow_nan=False, allow_subnormal=False, width=32),
                      min_size=10, max_size=10),
       top_k=st.sampled_from([0, 1, 3, 10]), top_p=st.floats(0.05, 1.0))
def test_truncation_mask_is_the_smallest_nucleus(logits, top_k, top_p):
    logits = np.asarray(logits, np.float32)[None]
    keep = np.asarray(_jitted_mask(top_k)(jnp.asarray(logits), top_p))[0]
    row = logits[0]
    assert keep[np.argmax(row)]
    if 0 < top_k < row.size:
        assert keep.sum() <= top_k + np.sum(row == np.sort(row)[-top_k]) - 1
    # Everything kept is at least as likely as everything dropped.
    if (~keep).any():
        assert row[keep].min() >= row[~keep].max()
    # Kept mass (renormalised over top-k) reaches top_p; dropping the least likely kept
    # tokens (all ties of the smallest kept logit) would fall short of it (up to float32
    # rounding).
    base = np.ones_like(keep) if not 0 < top_k < row.size else row >= np.sort(row)[-top_k]
    probs = np.exp(row - row.max()) * base
    probs /= probs.sum()
    assert probs[keep].sum() >= min(top_p, 1.0) - 1e-5 or keep.sum() == base.sum()
    above_smallest = keep & (row > row[keep].min())
    assert probs[above_smallest].sum() < top_p + 1e-5


def test_greedy_is_deterministic_and_small_temperature_matches_it():
    greedy, greedy_logp = _draw_many(5, greedy=True, temperature=0.5)
    assert (greedy == np.argmax(LOGITS, -1)).all()
    np.testing.assert_allclose(greedy_logp[0],
                               np.asarray(jax.nn.log_softmax(LOGITS / 0.5, -1)).max(-1),
                               rtol=1e-6)
    cold, _ = _draw_many(200, temperature=1e-4)
    assert (cold == np.argmax(LOGITS, -1)).all()


def test_traced_per_row_temperature_and_top_p():
    fn = jax.jit(lambda key, t, p: sample_from_logits(key, LOGITS, temperature=t, top_p=p))
    tokens, logp = fn(jax.random.key(1), jnp.array([1e-4, 1.0]), jnp.array([1.0, 1e-3]))
    np.testing.assert_array_equal(tokens, np.argmax(LOGITS, -1))
    np.testing.assert_allclose(logp[1], jax.nn.log_softmax(LOGITS[1])[2], rtol=1e-6)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=0.0), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_bad_sampling_arguments_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sample_from_logits(jax.random.key(0), LOGITS, **kwargs)


def test_degenerate_logits_give_no_nan():
    logits = jnp.array([[0.0, -jnp.inf, -jnp.inf, 5.0], [1.0, 1.0, 1.0, 1.0]])
    tokens, logp = jax.jit(lambda k, z: sample_from_logits(k, z, top_p=0.9, top_k=2))(
        jax.random.key(0), logits)
    assert np.isfinite(np.asarray(logp)).all()
    assert int(tokens[0]) in (0, 3)


def test_take_last_valid():
    logits = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    fallback = -jnp.ones((2, 3))
    out = take_last_valid(logits, jnp.array([3, 0]), fallback)
    np.testing.assert_array_equal(out, [logits[0, 2], [-1, -1, -1]])


# ----------------------------------------------------------------------------- generate

PROMPTS = np.array([[5, 9, 2, 7, 1, 0], [3, 3, 8, 0, 0, 0], [4, 6, 1, 2, 0, 0],
                    [7, 2, 0, 0, 0, 0]], np.int32)
PROMPT_LEN = np.array([5, 3, 4, 2], np.int32)
ACTIVE = np.array([True, True, False, True])
BUDGET = 7
CAPACITY = 16


@functools.lru_cache(maxsize=None)
def _generate_fn(greedy=False, stop_early=False):
    model, _, _ = make(SMALL)

    def run(params, key, eot_ids, temperature, row_budget):
        cache = init_cache(SMALL, 4, CAPACITY)
        out = model.apply({"params": params}, jnp.asarray(PROMPTS), cache,
                          num_valid=jnp.asarray(PROMPT_LEN), method="decode")
        last = take_last_valid(out.logits, jnp.asarray(PROMPT_LEN))
        gen = generate(model, params, out.cache, last, key, max_new_tokens=BUDGET,
                       eot_id=eot_ids, pad_id=0, active=jnp.asarray(ACTIVE),
                       temperature=temperature, greedy=greedy, top_k=0, top_p=0.95,
                       row_budget=row_budget, stop_early=stop_early)
        return out.cache, gen

    return jax.jit(run)


def _run(key=0, eot_ids=(-1, -1), temperature=0.7, row_budget=(BUDGET,) * 4, **kwargs):
    _, _, params = make(SMALL)
    prefill_cache, gen = _generate_fn(**kwargs)(
        params, jax.random.key(key), jnp.asarray(eot_ids, jnp.int32), jnp.float32(temperature),
        jnp.asarray(row_budget, jnp.int32))
    return prefill_cache, jax.tree.map(np.asarray, gen)


def test_generate_logp_values_and_cache_match_full_recomputation():
    prefill_cache, gen = _run()  # no eot: every active row runs the whole budget
    np.testing.assert_array_equal(gen.length, np.where(ACTIVE, BUDGET, 0))
    # Concatenate prompt + generated tokens and recompute with one full forward pass.
    _, _, params = make(SMALL)
    total = PROMPT_LEN + gen.length
    seqs = np.zeros((4, total.max()), np.int32)
    for b in range(4):
        seqs[b, :PROMPT_LEN[b]] = PROMPTS[b, :PROMPT_LEN[b]]
        seqs[b, PROMPT_LEN[b]:total[b]] = gen.tokens[b, :gen.length[b]]
    ref = jitted_forward(SMALL)(params, jnp.asarray(seqs))
    for b in np.flatnonzero(ACTIVE):
        positions = PROMPT_LEN[b] - 1 + np.arange(gen.length[b])  # logits that predicted them
        recomputed = log_softmax_at(ref.logits[b, positions], jnp.asarray(gen.tokens[b]), 0.7)
        np.testing.assert_allclose(gen.logp[b], recomputed, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(gen.values[b], ref.values[b, positions + 1], atol=1e-5)
        np.testing.assert_allclose(gen.last_logits[b], ref.logits[b, total[b] - 1], atol=1e-5)
    # The cache holds the whole turn: its length, and its keys equal a fresh prefill.
    np.testing.assert_array_equal(gen.cache.length, total)
    fresh = jax.jit(lambda p, t, nv: make(SMALL)[0].apply(
        {"params": p}, t, init_cache(SMALL, 4, CAPACITY), num_valid=nv, method="decode").cache)(
            params, jnp.asarray(seqs), jnp.asarray(total))
    for b in np.flatnonzero(ACTIVE):
        np.testing.assert_allclose(gen.cache.keys[:, b, :total[b]],
                                   fresh.keys[:, b, :total[b]], atol=1e-5)
    # The inactive row: pad only, zero logp, cache untouched bit for bit.
    assert (gen.tokens[2] == 0).all() and (gen.logp[2] == 0).all() and (gen.values[2] == 0).all()
    np.testing.assert_array_equal(gen.cache.keys[:, 2], prefill_cache.keys[:, 2])
    np.testing.assert_array_equal(gen.cache.values[:, 2], prefill_cache.values[:, 2])


def test_generate_stops_at_eot_and_pads_after():
    _, free = _run(key=3)
    eot = int(free.tokens[0, 2])  # a token row 0 emits at step 2 (maybe earlier too)
    other_stop = int(free.tokens[3, 4])
    _, gen = _run(eot_ids=(eot, other_stop), key=3)
    for b in np.flatnonzero(ACTIVE):
        hits = np.flatnonzero(np.isin(free.tokens[b], [eot, other_stop]))
        expected = hits[0] + 1 if hits.size else BUDGET
        assert gen.length[b] == expected
        np.testing.assert_array_equal(gen.tokens[b, :expected], free.tokens[b, :expected])
        np.testing.assert_allclose(gen.logp[b, :expected], free.logp[b, :expected], atol=1e-6)
        assert (gen.tokens[b, expected:] == 0).all() and (gen.logp[b, expected:] == 0).all()
    assert gen.length[0] <= 3 and gen.length[3] <= 5
    # stop_early (while_loop) produces the same outputs.
    _, early = _run(eot_ids=(eot, other_stop), key=3, stop_early=True)
    for field in ("tokens", "length", "logp", "values", "last_logits"):
        np.testing.assert_allclose(getattr(early, field), getattr(gen, field), atol=1e-6)


def test_generate_per_row_budget():
    _, free = _run(key=4)
    _, gen = _run(key=4, row_budget=(3, 0, 5, 7))
    np.testing.assert_array_equal(gen.length, [3, 0, 0, 7])  # row 2 is inactive anyway
    np.testing.assert_array_equal(gen.tokens[0, :3], free.tokens[0, :3])
    assert (gen.tokens[0, 3:] == 0).all() and (gen.tokens[1] == 0).all()
    np.testing.assert_array_equal(gen.cache.length, PROMPT_LEN + [3, 0, 0, 7])


def test_generate_is_one_device_program():
    """No host transfer inside prefill + generate (reuses the compiled program)."""
    _, _, params = make(SMALL)
    fn = _generate_fn()
    args = (params, jax.random.key(0), jnp.asarray((-1, -1), jnp.int32), jnp.float32(0.7),
            jnp.asarray((BUDGET,) * 4, jnp.int32))
    jax.block_until_ready(fn(*args))  # compiled already by the other tests, or here
    with jax.transfer_guard("disallow"):
        out = jax.block_until_ready(fn(*args))
    assert out[1].tokens.shape == (4, BUDGET)


def test_generate_greedy_is_deterministic_across_keys():
    _, a = _run(key=1, greedy=True)
    _, b = _run(key=2, greedy=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    _, c = _run(key=1, temperature=1e-4)  # temperature -> 0 with top_p 0.95 == greedy
    np.testing.assert_array_equal(a.tokens, c.tokens)


def test_generate_argument_errors():
    model, _, params = make(SMALL)
    cache = init_cache(SMALL, 2, 8)
    logits = jnp.zeros((2, SMALL.vocab_size))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, params, cache, logits, jax.random.key(0), max_new_tokens=0, eot_id=1,
                 pad_id=0)
    with pytest.raises(ValueError, match="last_logits"):
        generate(model, params, cache, logits[:1], jax.random.key(0), max_new_tokens=2,
                 eot_id=1, pad_id=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, params, cache, logits, jax.random.key(0), max_new_tokens=2, eot_id=1,
                 pad_id=0, temperature=-1.0)


@pytest.mark.slow  # one extra sharded compilation of the whole prefill + generate program
def test_generate_sharded_matches_unsharded():
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from arl.models import LOGICAL_AXIS_RULES, param_shardings

    _, boxed, params = make(SMALL)
    _, ref = _run(key=5)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
    sharded = jax.device_put(params, param_shardings(boxed, mesh, LOGICAL_AXIS_RULES))
    replicated = NamedSharding(mesh, P())
    with jax.set_mesh(mesh):
        _, gen = _generate_fn()(
            sharded, jax.device_put(jax.random.key(5), replicated),
            jnp.asarray((-1, -1), jnp.int32), jnp.float32(0.7),
            jnp.asarray((BUDGET,) * 4, jnp.int32))
    np.testing.assert_array_equal(gen.tokens, ref.tokens)
    np.testing.assert_allclose(gen.logp, ref.logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gen.cache.keys, ref.cache.keys, rtol=1e-5, atol=1e-6)


# A few values so that rows tie often; NaN, infinities and both zeros included.
_ARGMAX_VALUES = (np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.5, 1e-30)


@settings(max_examples=80, deadline=None)  # each new shape compiles twice
@given(st.integers(1, 5), st.integers(1, 40), st.data())
def test_first_argmax_is_numpy_argmax_ties_nan_and_infinities_included(rows, width, data):
    x = np.asarray(data.draw(st.lists(st.sampled_from(_ARGMAX_VALUES), min_size=rows * width,
                                      max_size=rows * width)), np.float32).reshape(rows, width)
    expected = np.argmax(x, axis=-1)  # NumPy: first index of the max, a NaN counts as max
    np.testing.assert_array_equal(jax.jit(first_argmax)(x), expected)
    np.testing.assert_array_equal(jax.jit(jax.vmap(first_argmax))(x[:, None, :])[:, 0],
                                  expected)
    assert jax.jit(first_argmax)(x).dtype == jnp.int32


def test_first_argmax_at_vocabulary_sizes_equals_jnp_argmax():
    for shape in ((64, 64), (8, 32000), (3, 151936)):
        x = jax.random.gumbel(jax.random.key(shape[1]), shape)
        x = x.at[0, shape[1] // 2].set(jnp.max(x[0]))  # a tie at the maximum
        np.testing.assert_array_equal(jax.jit(first_argmax)(x), jnp.argmax(x, axis=-1))


def test_sampled_tokens_are_those_jax_random_categorical_draws():
    """Without noise drawn ahead, the token is `jax.random.categorical`'s for the key (on
    the allowed logits / temperature), and greedy is `jnp.argmax`."""
    keys = jax.random.split(jax.random.key(3), 256)
    logits = jax.random.normal(jax.random.key(4), (4, 512)) * 3.0
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9)):
        tokens, _ = jax.jit(jax.vmap(lambda k: sample_from_logits(
            k, logits, temperature=0.8, top_k=top_k, top_p=top_p)))(keys)
        scaled = logits / 0.8
        allowed = jnp.where(truncation_mask(scaled, top_k=top_k, top_p=top_p), scaled,
                            -jnp.inf)
        expected = jax.jit(jax.vmap(lambda k: jax.random.categorical(k, allowed)))(keys)
        np.testing.assert_array_equal(tokens, expected)
        assert len(np.unique(tokens)) > 4
    greedy, _ = jax.jit(lambda: sample_from_logits(None, logits, greedy=True))()
    np.testing.assert_array_equal(greedy, jnp.argmax(logits, axis=-1))


def test_sample_from_logits_with_noise_drawn_ahead_is_categorical():
    """`gumbel=` noise drawn with a key gives the very token `jax.random.categorical` draws
    with that key, with and without truncation."""
    keys = jax.random.split(jax.random.key(7), 64)
    for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.8)):
        draw = jax.jit(jax.vmap(lambda k: sample_from_logits(
            k, LOGITS, temperature=0.7, top_k=top_k, top_p=top_p)))
        ahead = jax.jit(jax.vmap(lambda k: sample_from_logits(
            None, LOGITS, temperature=0.7, top_k=top_k, top_p=top_p,
            gumbel=jax.random.gumbel(k, LOGITS.shape, jnp.float32))))
        (tokens, logp), (tokens_ahead, logp_ahead) = draw(keys), ahead(keys)
        np.testing.assert_array_equal(tokens_ahead, tokens)
        np.testing.assert_array_equal(logp_ahead, logp)


@pytest.mark.parametrize("stop_early", [False, True])
def test_generate_draws_the_same_tokens_with_noise_drawn_ahead(monkeypatch, stop_early):
    """Drawing every step's Gumbel noise before decoding (the default at these sizes) and
    drawing it step by step (beyond `PRECOMPUTED_NOISE_LIMIT`) give identical outputs."""
    from arl.models import sampling  # pylint: disable=import-outside-toplevel
    _, _, params = make(SMALL)

    def run():  # a fresh jit: the limit is read while tracing
        return jax.tree.map(np.asarray, jax.jit(_generate_fn.__wrapped__(
            stop_early=stop_early))(params, jax.random.key(11), jnp.asarray([-1, -1]),
                                    jnp.float32(0.9), jnp.full((4,), BUDGET, jnp.int32)))

    ahead = run()
    monkeypatch.setattr(sampling, "PRECOMPUTED_NOISE_LIMIT", 0)
    step_by_step = run()
    jax.tree.map(np.testing.assert_array_equal, ahead, step_by_step)
    assert len(np.unique(ahead[1].tokens)) > 3  # really sampled

"""Chunked log-probs / entropy equal the naive full-logits computation, gradients included."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.algorithms import entropy, token_logprobs
from arl.models import TransformerConfig, unembedding_matrix
from arl.models.chunked_logprobs import chunked_token_logprobs, model_token_logprobs
from tests.models.helpers import jitted_forward, make


def _naive(hidden, unembed, targets):
    """Full [B, T, V] float32 logits, then log_softmax."""
    logits = jnp.einsum("btd,dv->btv", hidden, unembed, preferred_element_type=jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def _numpy_reference(hidden, unembed, targets):
    logits = np.asarray(hidden, np.float64) @ np.asarray(unembed, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    logp = np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]
    ent = -(np.exp(log_probs) * log_probs).sum(-1)
    return logp, ent


@pytest.mark.parametrize("length, chunk", [(13, 5),
                                           pytest.param(7, 64, marks=pytest.mark.slow)])
def test_chunked_matches_numpy_and_naive(length, chunk):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k1, (3, length, 8))
    unembed = 2.0 * jax.random.normal(k2, (8, 50))
    targets = jax.random.randint(k3, (3, length), 0, 50)
    logp, ent = jax.jit(chunked_token_logprobs, static_argnums=3)(hidden, unembed, targets, chunk)
    ref_logp, ref_ent = _numpy_reference(hidden, unembed, targets)
    assert logp.dtype == ent.dtype == jnp.float32 and logp.shape == (3, length)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=1e-5)
    naive_logp, naive_ent = _naive(hidden, unembed, targets)
    np.testing.assert_allclose(logp, naive_logp, atol=1e-5)
    np.testing.assert_allclose(ent, naive_ent, atol=1e-5)
    # arl.algorithms' kernels on the full logits agree too (their entropy uses
    # lse - sum p z, which loses ~1e-5 to cancellation on peaked rows).
    logits = jnp.einsum("btd,dv->btv", hidden, unembed)
    np.testing.assert_allclose(logp, token_logprobs(logits, targets), atol=1e-5)
    np.testing.assert_allclose(ent, entropy(logits), atol=1e-4)


def test_chunked_gradients_equal_naive():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    hidden = jax.random.normal(k1, (2, 11, 8))
    unembed = jax.random.normal(k2, (8, 40))
    targets = jax.random.randint(k3, (2, 11), 0, 40)
    weights = jax.random.normal(k4, (2, 11))

    def loss(fn):
        def f(h, w):
            logp, ent = fn(h, w)
            return jnp.sum(weights * logp) + 0.3 * jnp.sum(weights * ent)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    chunked = loss(lambda h, w: chunked_token_logprobs(h, w, targets, 3))(hidden, unembed)
    naive = loss(lambda h, w: _naive(h, w, targets))(hidden, unembed)
    for got, want in zip(chunked, naive):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _numpy_gradients(hidden, unembed, targets, temperature, g_logp, g_ent):
    """d/d(hidden, unembed) of sum(g_logp logp + g_ent H) for logits h W / tau, float64,
    from dz_j = g_logp (1[j = y] - p_j) - g_ent p_j (log p_j + H)."""
    h, w = np.asarray(hidden, np.float64), np.asarray(unembed, np.float64)
    z = h @ w / temperature
    z = z - z.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(log_p)
    ent = -(p * log_p).sum(-1, keepdims=True)
    onehot = np.arange(w.shape[1]) == np.asarray(targets)[..., None]
    dz = (np.asarray(g_logp)[..., None] * (onehot - p)
          - np.asarray(g_ent)[..., None] * p * (log_p + ent)) / temperature
    return dz @ w.T, np.einsum("btd,btv->dv", h, dz)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_tempered_gradients_equal_numpy(dtype, tol):
    """Temperature 0.7, a tail chunk (11 = 4 + 4 + 3), bfloat16 too: the gradient of
    `unembed` comes back in its dtype, accumulated over the chunks in float32."""
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(8), 5)
    hidden = jax.random.normal(k1, (2, 11, 8)).astype(dtype)
    unembed = jax.random.normal(k2, (8, 40)).astype(dtype)
    targets = jax.random.randint(k3, (2, 11), 0, 40)
    g_logp, g_ent = jax.random.normal(k4, (2, 11)), jax.random.normal(k5, (2, 11))

    def f(h, w):
        logp, ent = chunked_token_logprobs(h, w, targets, 4, temperature=0.7)
        return jnp.sum(g_logp * logp) + jnp.sum(g_ent * ent)

    d_hidden, d_unembed = jax.jit(jax.grad(f, argnums=(0, 1)))(hidden, unembed)
    assert d_hidden.dtype == d_unembed.dtype == dtype
    want_h, want_w = _numpy_gradients(hidden.astype(jnp.float32), unembed.astype(jnp.float32),
                                      targets, 0.7, g_logp, g_ent)
    scale = lambda x: np.abs(x).max()
    np.testing.assert_allclose(np.asarray(d_hidden, np.float64), want_h,
                               atol=tol * scale(want_h), rtol=tol)
    np.testing.assert_allclose(np.asarray(d_unembed, np.float64), want_w,
                               atol=tol * scale(want_w), rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_vocab_major_matrix_gives_the_same_values_and_gradients(dtype, tol):
    """A tied table passed as stored, [V, D] (`vocab_major=True`): the same log-probs,
    entropies and gradients as its transpose passed [D, V], the table's gradient [V, D]."""
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(10), 5)
    hidden = jax.random.normal(k1, (2, 11, 8)).astype(dtype)
    table = jax.random.normal(k2, (40, 8)).astype(dtype)
    targets = jax.random.randint(k3, (2, 11), 0, 40)
    g_logp, g_ent = jax.random.normal(k4, (2, 11)), jax.random.normal(k5, (2, 11))

    def f(h, w, vocab_major):
        logp, ent = chunked_token_logprobs(h, w, targets, 4, temperature=0.7,
                                           vocab_major=vocab_major)
        return jnp.sum(g_logp * logp) + jnp.sum(g_ent * ent), (logp, ent)

    grad = jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True), static_argnums=2)
    (d_hidden, d_table), (logp, ent) = grad(hidden, table, True)
    (want_h, want_w), (want_logp, want_ent) = grad(hidden, table.T, False)
    assert d_table.shape == table.shape and d_table.dtype == dtype
    for got, want in ((logp, want_logp), (ent, want_ent), (d_hidden, want_h),
                      (d_table, want_w.T)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=tol)
    _, numpy_w = _numpy_gradients(hidden.astype(jnp.float32), table.T.astype(jnp.float32),
                                  targets, 0.7, g_logp, g_ent)
    np.testing.assert_allclose(np.asarray(d_table, np.float64), numpy_w.T,
                               atol=tol * np.abs(numpy_w).max(), rtol=tol)


def test_bfloat16_matrix_gradient_is_accumulated_in_float32():
    """A bfloat16 matrix's gradient summed over 96 chunks of one position is rounded to
    bfloat16 once, at the end: within 2^-7 of float64 on its large entries (summing the
    chunks in bfloat16, as autodiff of a bfloat16 matrix does, drifts well past that)."""
    k1, k2, k3 = jax.random.split(jax.random.key(9), 3)
    hidden = jax.random.normal(k1, (4, 96, 16)).astype(jnp.bfloat16)
    unembed = jax.random.normal(k2, (16, 32)).astype(jnp.bfloat16)
    targets = jax.random.randint(k3, (4, 96), 0, 32)
    grad = jax.jit(jax.grad(
        lambda w: jnp.sum(chunked_token_logprobs(hidden, w, targets, 1)[0])))(unembed)
    _, want = _numpy_gradients(hidden.astype(jnp.float32), unembed.astype(jnp.float32),
                               targets, 1.0, np.ones((4, 96)), np.zeros((4, 96)))
    large = np.abs(want) > 0.25 * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(grad, np.float64)[large], want[large],
                               rtol=2.0 ** -7)


@pytest.mark.slow
def test_vmap_over_an_extra_axis():
    hidden = jax.random.normal(jax.random.key(2), (4, 2, 6, 8))
    unembed = jax.random.normal(jax.random.key(3), (8, 20))
    targets = jax.random.randint(jax.random.key(4), (4, 2, 6), 0, 20)
    logp, _ = jax.vmap(lambda h, t: chunked_token_logprobs(h, unembed, t, 4))(hidden, targets)
    ref, _ = _numpy_reference(hidden, unembed, targets)
    np.testing.assert_allclose(logp, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_hidden_gives_float32_statistics():
    hidden = jax.random.normal(jax.random.key(5), (2, 9, 16)).astype(jnp.bfloat16)
    unembed = jax.random.normal(jax.random.key(6), (16, 30)).astype(jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(7), (2, 9), 0, 30)
    logp, ent = chunked_token_logprobs(hidden, unembed, targets, 4)
    assert logp.dtype == ent.dtype == jnp.float32
    ref_logp, ref_ent = _numpy_reference(hidden.astype(jnp.float32), unembed.astype(jnp.float32),
                                         targets)
    # bf16 inputs are exact in f32; the only difference is f32 accumulation order.
    np.testing.assert_allclose(logp, ref_logp, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_model_token_logprobs_equals_full_logits_path():
    config = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                               num_kv_heads=2, mlp_dim=64, max_len=32)
    model, _, params = make(config)
    tokens = jax.random.randint(jax.random.key(8), (2, 10), 0, 64)
    logp, ent = jax.jit(lambda p, t: model_token_logprobs(model, p, t, 4, temperature=0.7))(
        params, tokens)
    logits = jitted_forward(config)(params, tokens).logits[:, :-1] / 0.7
    np.testing.assert_allclose(logp[:, 1:], token_logprobs(logits, tokens[:, 1:]), atol=1e-5)
    np.testing.assert_allclose(ent[:, 1:], entropy(logits), atol=1e-4)
    np.testing.assert_array_equal(logp[:, 0], 0.0)
    assert unembedding_matrix(params, config).shape == (32, 64)


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=0), "chunk_size"),
    (dict(hidden=np.zeros((2, 3))), "hidden"),
    (dict(unembed=np.zeros((5, 7))), "unembed"),
    (dict(unembed=np.zeros((4, 7)), vocab_major=True), r"\[V, D\] with D=4"),
    (dict(vocab_major=1), "vocab_major must be True or False"),
    (dict(targets=np.zeros((2, 4), np.int32)), "targets"),
    (dict(targets=np.zeros((2, 3), np.float32)), "targets"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(hidden=np.zeros((2, 3, 4), np.float32), unembed=np.zeros((4, 7), np.float32),
                targets=np.zeros((2, 3), np.int32), chunk_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        chunked_token_logprobs(**args)


@pytest.mark.parametrize("algorithm", [pytest.param("grpo", marks=pytest.mark.slow), "ppo"])
def test_trainer_forward_with_logprob_chunk_equals_full_logits(algorithm):
    """config.model.logprob_chunk > 0 switches the train step's log-prob/entropy/value
    forward to the chunked path; same numbers as the full-logits path."""
    from arl import config as config_lib
    from arl.trainers import TokenTrainer

    def trainer(chunk):
        c = config_lib.default_config()
        c.algorithm, c.env.name, c.env.kwargs = algorithm, "guess_number", {"max_n": 8}
        c.rollout.num_tasks, c.rollout.group_size, c.rollout.temperature = 2, 2, 0.8
        c.model.d_model, c.model.num_heads, c.model.num_kv_heads, c.model.mlp_dim = 32, 4, 2, 64
        c.model.num_layers, c.model.logprob_chunk = 1, chunk
        return TokenTrainer(c)

    full, chunked = trainer(0), trainer(5)
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, full.model.config.vocab_size)
    params = jax.jit(full.model.init)(jax.random.key(0), tokens)["params"]
    params = nn.unbox(params)
    got = jax.jit(chunked.policy.score)(params, tokens)
    want = jax.jit(full.policy.score)(params, tokens)
    np.testing.assert_allclose(got.logp, want.logp, atol=1e-5)
    np.testing.assert_allclose(got.entropy, want.entropy, atol=1e-4)
    if algorithm == "ppo":
        np.testing.assert_allclose(got.values, want.values, atol=1e-6)
    else:
        assert got.values is None and want.values is None


@pytest.mark.parametrize("field, value", [("dtype", "float16"), ("logprob_chunk", -1)])
def test_config_rejects_bad_model_dtype_and_chunk(field, value):
    from arl import config as config_lib

    c = config_lib.default_config()
    c.model[field] = value
    with pytest.raises(config_lib.ConfigError, match=f"model.{field}"):
        config_lib.validate(c, num_devices=1)

"""Token sampling and KV-cached generation, all inside `jax.jit`.

Behaviour log-probabilities. For a sampled token a with logits z,

    logp(a) = log_softmax(z / temperature)[a]          (float32)

which is exactly what the trainer recomputes from a full forward pass of the same
parameters (`jax.nn.log_softmax(logits / temperature)` at the token). Top-k / top-p
truncation changes which tokens can be drawn but is NOT reflected in logp, as in verl and
TRL: the importance ratio is between the untruncated tempered policies, so the recorded
and the recomputed quantities agree to float precision.

Static vs traced arguments of `sample_from_logits` / `generate`:
  * `top_k` (int) and `greedy` (bool) must be static Python values (they change shapes
    or the program); `max_new_tokens` and `stop_early` too.
  * `temperature` and `top_p` may be Python floats or traced arrays of shape [] or [B]
    (per-row values); Python values are validated before tracing, and a Python
    `top_p >= 1` skips the sort entirely.
  * `eot_id` (one id or a list/array of stop ids), `pad_id` and `row_budget` may be
    Python values or traced int32 arrays.
  * A traced temperature must be > 0 (not checkable before tracing; 0 gives inf/NaN).
"""

from __future__ import annotations

import collections.abc
import numbers
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import struct

from arl import backend
from arl.models.transformer import KVCache, Transformer, decodes_per_layer, per_layer_params

# Most elements (max_new_tokens x rows x vocabulary) of Gumbel noise `generate` draws ahead
# of decoding; beyond it (large vocabularies) each step draws its own.
PRECOMPUTED_NOISE_LIMIT = 1 << 24


def _check_temperature(temperature):
    if isinstance(temperature, numbers.Number) and not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {temperature}")


def _check_top_k(top_k):
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be a static int >= 0 (0 disables it), got {top_k!r}")


def _check_top_p(top_p):
    if isinstance(top_p, numbers.Number) and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")


def _per_row(x, batch):
    """A scalar or [B] argument as a float32 [B, 1] column."""
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == 0:
        return jnp.broadcast_to(x, (batch, 1))
    chex.assert_shape(x, (batch,))
    return x[:, None]


def truncation_mask(scaled_logits: jax.Array, *, top_k: int = 0, top_p=1.0) -> jax.Array:
    """Boolean [B, V]: tokens that top-k then top-p (nucleus) sampling may draw.

    top-k keeps the k largest logits (ties at the k-th value are kept). top-p keeps the
    smallest prefix of the descending-probability order whose mass reaches top_p, with
    probabilities renormalised over the top-k survivors (Holtzman et al. 2020, "The Curious
    Case of Neural Text Degeneration", arXiv 1904.09751); the most likely token is always
    kept. Applied to temperature-scaled logits, the Hugging Face / vLLM order.
    """
    _check_top_k(top_k)
    _check_top_p(top_p)
    batch, vocab = scaled_logits.shape
    keep = jnp.ones(scaled_logits.shape, bool)
    if 0 < top_k < vocab:
        kth_largest = jax.lax.top_k(scaled_logits, top_k)[0][:, -1:]
        keep = scaled_logits >= kth_largest
    if not (isinstance(top_p, numbers.Number) and top_p >= 1):
        masked = jnp.where(keep, scaled_logits, -jnp.inf)
        sorted_logits = -jnp.sort(-masked, axis=-1)
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        mass_before = mass_before.at[:, 0].set(0.0)  # top token always kept
        in_nucleus = mass_before < _per_row(top_p, batch)
        threshold = jnp.min(jnp.where(in_nucleus, sorted_logits, jnp.inf), axis=-1,
                            keepdims=True)
        keep = keep & (scaled_logits >= threshold)
    return keep


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32: the first index of the largest entry of each row
    (a NaN counts as the largest, as in `jnp.argmax`).

    On the CPU it is computed as two plain reductions, the row maximum and then the
    smallest index holding it. XLA:CPU runs `argmax`'s single (value, index) reduction as
    a scalar loop, while these two vectorise: a whole draw (noise and log-prob included)
    1.8-3.9x faster from [64, 64] to [8, 151936] logits (docs/performance.md,
    "Sampling"). The indices are the same in every case, ties and NaN included. Other
    backends keep `jnp.argmax`.
    """
    if not backend.argmax_as_two_reductions():
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    largest = jnp.max(x, axis=-1, keepdims=True)
    holds_largest = (x == largest) | (jnp.isnan(x) & jnp.isnan(largest))
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(holds_largest, index, x.shape[-1]), axis=-1)


def sample_from_logits(key: jax.Array | None, logits: jax.Array, *, temperature=1.0,
                       top_k: int = 0, top_p=1.0, greedy: bool = False,
                       gumbel: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. logits [B, V] -> (tokens int32 [B], logp float32 [B]).

    logp = log_softmax(logits / temperature)[token] in float32 (truncation not reflected;
    see the module docstring). greedy: token = argmax(logits) (first index on ties), logp
    computed the same way. temperature and top_p: Python float or array [] / [B];
    top_k, greedy: static.

    gumbel: optional float32 [B, V] noise `jax.random.gumbel(key, (B, V))` drawn ahead
    (key is then unused); the token is the same as `jax.random.categorical(key, ...)`
    draws, which is argmax(logits + that noise).
    """
    _check_temperature(temperature)
    _check_top_k(top_k)
    _check_top_p(top_p)
    chex.assert_rank(logits, 2)
    batch = logits.shape[0]
    scaled = logits.astype(jnp.float32) / _per_row(temperature, batch)
    if greedy:
        tokens = first_argmax(scaled)
    else:
        keep = truncation_mask(scaled, top_k=top_k, top_p=top_p)
        allowed = jnp.where(keep, scaled, -jnp.inf)
        if gumbel is None:
            # What `jax.random.categorical(key, allowed)` draws, with its argmax as above.
            gumbel = jax.random.gumbel(key, allowed.shape, allowed.dtype)
        else:
            chex.assert_equal_shape((gumbel, logits))
        tokens = first_argmax(allowed + gumbel)
    logp = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)
    return tokens, logp[:, 0]


def row_noise(row_keys: jax.Array, step, vocab: int) -> jax.Array:
    """float32 [B, vocab]: the Gumbel noise of each row's draw number `step` (a scalar or
    int [B]), from the row's own key (`jax.random.fold_in(row_keys[b], step)`): the same for a row wherever and with
    whichever other rows it is drawn."""
    steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), row_keys.shape[:1])
    return jax.vmap(lambda k, t: jax.random.gumbel(jax.random.fold_in(k, t), (vocab,),
                                                   jnp.float32))(row_keys, steps)


def take_last_valid(logits: jax.Array, num_valid: jax.Array, fallback: jax.Array | None = None
                    ) -> jax.Array:
    """Logits [B, T, V] at each row's last valid position num_valid[b] - 1 -> [B, V].

    Rows with num_valid 0 get `fallback` [B, V] (zeros when None): e.g. the previous
    last_logits of a row that received no new tokens. Works for any [B, T, ...] array.
    """
    chex.assert_rank(num_valid, 1)
    chex.assert_equal_shape_prefix((logits, num_valid), 1)
    index = jnp.clip(num_valid - 1, 0, logits.shape[1] - 1)
    index = index.reshape((-1, 1) + (1,) * (logits.ndim - 2))
    last = jnp.take_along_axis(logits, index, axis=1)[:, 0]
    if fallback is None:
        fallback = jnp.zeros_like(last)
    chex.assert_equal_shape((last, fallback))
    has_tokens = (num_valid > 0).reshape((-1,) + (1,) * (last.ndim - 1))
    return jnp.where(has_tokens, last, fallback)


@struct.dataclass
class GenerateOutput:
    """Result of `generate`.

    tokens: int32 [B, N], pad_id after a row stopped (and everywhere for inactive rows).
    logp: float32 [B, N] behaviour log-probs, 0 after stop.
    length: int32 [B] tokens emitted, including the eot token.
    cache: the cache with every emitted token (eot included) appended.
    last_logits: float32 [B, V] logits after each row's last emitted token (the input
      last_logits for rows that emitted nothing).
    values: float32 [B, N] value-head output at each emitted token's position (the value
      of the state after that token), 0 after stop; None without a value head.
    """

    tokens: jax.Array
    logp: jax.Array
    length: jax.Array
    cache: KVCache
    last_logits: jax.Array
    values: jax.Array | None = None


def _as_variables(params):
    if isinstance(params, collections.abc.Mapping) and set(params) == {"params"}:
        return params
    return {"params": params}


def generate(model: Transformer, params: Any, cache: KVCache, last_logits: jax.Array,
             key: jax.Array, *, max_new_tokens: int, eot_id, pad_id, active=None,
             temperature=1.0, top_k: int = 0, top_p=1.0, greedy: bool = False,
             row_budget=None, stop_early: bool = False, row_keys=None) -> GenerateOutput:
    """Sample up to `max_new_tokens` tokens per row with the KV cache, inside jit.

    Each step: sample from the current logits (`sample_from_logits`), record logp, feed
    the token through `model` with num_valid = 1 for rows still generating and 0 for
    finished / inactive rows (so their cache stays bit-for-bit unchanged). A row stops
    after emitting a stop id (`eot_id`) or when its budget runs out; either way its cache
    ends up holding the whole turn, eot included.

    Args:
      model: a `Transformer`. params: its "params" collection (boxed or plain), or the
        full variables dict {"params": ...}.
      cache: the cache after the prefill; every row needs room for max_new_tokens more
        positions (writes past capacity are silently dropped). Stacked or per-layer
        (`KVCache.per_layer()`), returned in the same form; with every layer unrolled
        (`decodes_per_layer`) the loop runs on the per-layer form either way.
      last_logits: [B, V] logits at each row's last valid position (`take_last_valid`).
      key: PRNG key (split once per step).
      eot_id: the end-of-turn id, or a sequence / int array [K] of stop ids.
      active: bool [B]; inactive rows emit nothing (pad, length 0, cache unchanged).
      row_budget: optional int32 [B] per-row token budgets (<= max_new_tokens); a row stops
        after emitting row_budget[b] tokens. Default: max_new_tokens for every row.
      stop_early: use a `lax.while_loop` that exits once every row has stopped instead of
        a `lax.scan` over the whole budget; same results, less work for short turns (not
        reverse-differentiable, which generation never needs).
      row_keys: optional [B] keys, one per row: token t of row b is drawn with the noise
        `row_noise(row_keys, t, V)[b]` instead of from `key` (unused then), so a row's draws
        do not depend on the other rows or its position in the batch (what slot scheduling,
        `arl.rollout.slots`, needs to replay the same episodes).
    """
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    _check_temperature(temperature)
    _check_top_k(top_k)
    _check_top_p(top_p)
    batch = cache.length.shape[0]
    chex.assert_rank(last_logits, 2)
    if last_logits.shape[0] != batch:
        raise ValueError(f"generate: last_logits must be [B, V] with B={batch} "
                         f"(cache.length), got {last_logits.shape}")
    active = jnp.ones((batch,), bool) if active is None else jnp.asarray(active, bool)
    chex.assert_shape(active, (batch,))
    if row_budget is not None:
        row_budget = jnp.asarray(row_budget, jnp.int32)
        chex.assert_shape(row_budget, (batch,))
        active = active & (row_budget > 0)
    variables = _as_variables(params)
    has_values = model.config.value_head
    stop_ids = jnp.atleast_1d(jnp.asarray(eot_id, jnp.int32))
    chex.assert_rank(stop_ids, 1)
    pad_id = jnp.asarray(pad_id, jnp.int32)

    def step(carry, step_randomness):
        cache, logits, done, length = carry
        step_key, gumbel = step_randomness
        token, logp = sample_from_logits(step_key, logits, temperature=temperature,
                                         top_k=top_k, top_p=top_p, greedy=greedy,
                                         gumbel=gumbel)
        emitting = ~done
        token = jnp.where(emitting, token, pad_id)
        logp = jnp.where(emitting, logp, 0.0)
        out = model.apply(variables, token[:, None], cache,
                          num_valid=emitting.astype(jnp.int32), method="decode")
        logits = jnp.where(emitting[:, None], out.logits[:, 0], logits)
        value = jnp.where(emitting, out.values[:, 0], 0.0) if has_values else None
        is_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        length = length + emitting.astype(jnp.int32)
        done = done | (emitting & is_stop)
        if row_budget is not None:
            done = done | (length >= row_budget)
        return (out.cache, logits, done, length), (token, logp, value)

    # With every layer unrolled (`TransformerConfig.layer_unroll`), decode on one cache
    # buffer per layer, read and written in place at every token, and on weights sliced
    # per layer once, here: from the stacked cache and weights XLA copies a layer's slice
    # out at every token and layer.
    per_layer = decodes_per_layer(model.config)
    restack = per_layer and not cache.is_per_layer
    if per_layer:
        cache = cache.per_layer()
        variables = {**variables, "params": per_layer_params(variables["params"])}
    carry = (cache, last_logits.astype(jnp.float32), ~active, jnp.zeros((batch,), jnp.int32))
    vocab = last_logits.shape[1]
    if row_keys is not None and not greedy:
        chex.assert_shape(row_keys, (batch,))
        steps = jnp.arange(max_new_tokens)
        if max_new_tokens * batch * vocab <= PRECOMPUTED_NOISE_LIMIT:
            noise = jax.vmap(lambda t: row_noise(row_keys, t, vocab))(steps)
        else:
            noise = None
        step_randomness = (steps, noise)

        def draw(step_and_noise):
            t, gumbel = step_and_noise
            return None, row_noise(row_keys, t, vocab) if gumbel is None else gumbel

        inner_step = step
        step = lambda carry, randomness: inner_step(carry, draw(randomness))
    elif not greedy and max_new_tokens * batch * vocab <= PRECOMPUTED_NOISE_LIMIT:
        step_keys = jax.random.split(key, max_new_tokens)
        # The same noise `jax.random.categorical` draws step by step, drawn in one call:
        # on CPU each threefry call is a small loop, and one per decoded token costs more
        # than the bits.
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (batch, vocab), jnp.float32))(
            step_keys)
        step_randomness = (step_keys, noise)
    else:
        step_randomness = (jax.random.split(key, max_new_tokens), None)

    if not stop_early:
        carry, (tokens, logp, values) = jax.lax.scan(step, carry, step_randomness)
        tokens, logp = tokens.T, logp.T
        values = values.T if has_values else None
    else:
        buffers = (jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
                   jnp.zeros((batch, max_new_tokens), jnp.float32),
                   jnp.zeros((batch, max_new_tokens), jnp.float32))

        def cond(state):
            index, (_, _, done, _), _ = state
            return (index < max_new_tokens) & ~jnp.all(done)

        def body(state):
            index, carry, (tokens, logp, values) = state
            carry, (token, lp, value) = step(
                carry, jax.tree.map(lambda x: x[index], step_randomness))
            tokens = tokens.at[:, index].set(token)
            logp = logp.at[:, index].set(lp)
            if has_values:
                values = values.at[:, index].set(value)
            return index + 1, carry, (tokens, logp, values)

        _, carry, (tokens, logp, values) = jax.lax.while_loop(
            cond, body, (jnp.int32(0), carry, buffers))
        values = values if has_values else None

    cache, logits, _, length = carry
    if restack:
        cache = cache.stacked()
    return GenerateOutput(tokens=tokens, logp=logp, length=length, cache=cache,
                          last_logits=logits, values=values)

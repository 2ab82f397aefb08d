"""Token log-probabilities and entropy from logits: the single implementation.

Both compute in float32 whatever the logits' dtype (bfloat16 logits lose too much
precision in a log-sum-exp over a large vocabulary).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v


def token_logprobs(logits, tokens) -> jax.Array:
    """Log-probability of each token under its logits.

    .. math:: \\log \\pi(y_t) = z_{t, y_t} - \\log\\sum_v e^{z_{t, v}}

    i.e. `log_softmax(logits)` gathered at `tokens`, computed in float32 (the gather
    happens before the normalisation so no `[..., V]` float32 copy of the
    log-probabilities is materialised beyond the log-sum-exp's own).

    Args:
        logits: [..., V] float (e.g. [B, T, V]).
        tokens: [...] int, the shape of `logits` without its last axis (e.g. [B, T]).
            Ids must lie in [0, V).

    Returns:
        [...] float32 log-probabilities.
    """
    fn = "token_logprobs"
    logits = v.floating(fn, "logits", logits, min_rank=1, layout="[..., V]")
    tokens = v.integer(fn, "tokens", tokens)
    v.shape(fn, "tokens", tokens, logits.shape[:-1], "logits.shape[:-1]")
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


def entropy(logits) -> jax.Array:
    """Entropy of the categorical distribution given by `logits`, in float32.

    .. math:: H = \\log\\sum_v e^{z_v} - \\sum_v \\mathrm{softmax}(z)_v\\, z_v

    Entries with probability 0 (e.g. logits of -inf for banned tokens) contribute 0.

    Args:
        logits: [..., V] float.

    Returns:
        [...] float32 entropies.
    """
    logits = v.floating("entropy", "logits", logits, min_rank=1, layout="[..., V]")
    logits = logits.astype(jnp.float32)
    log_normaliser = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - log_normaliser)
    # Double where: a -inf logit must not turn 0 * -inf into NaN, forward or backward.
    weighted = probs * jnp.where(probs > 0, logits, 0.0)
    return log_normaliser[..., 0] - jnp.sum(weighted, axis=-1)


def token_logprobs_and_entropy(logits, tokens) -> tuple[jax.Array, jax.Array]:
    """`(token_logprobs(logits, tokens), entropy(logits))` from one log-sum-exp.

    .. math:: \\log \\pi(y_t) = z_{t, y_t} - \\mathrm{lse}_t, \\qquad
              H_t = \\mathrm{lse}_t - \\sum_v \\mathrm{softmax}(z_t)_v\\, z_{t, v}

    with the same float32 formulas (and the same treatment of zero-probability entries)
    as the two functions, so the results agree with them up to the order XLA fuses the
    reductions in.

    Args:
        logits: [..., V] float.
        tokens: [...] int ids in [0, V), the shape of `logits` without its last axis.

    Returns:
        ([...] float32 log-probabilities, [...] float32 entropies).
    """
    fn = "token_logprobs_and_entropy"
    logits = v.floating(fn, "logits", logits, min_rank=1, layout="[..., V]")
    tokens = v.integer(fn, "tokens", tokens)
    v.shape(fn, "tokens", tokens, logits.shape[:-1], "logits.shape[:-1]")
    logits = logits.astype(jnp.float32)
    log_normaliser = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    chosen = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - log_normaliser)
    weighted = probs * jnp.where(probs > 0, logits, 0.0)
    log_normaliser = log_normaliser[..., 0]
    return chosen - log_normaliser, log_normaliser - jnp.sum(weighted, axis=-1)

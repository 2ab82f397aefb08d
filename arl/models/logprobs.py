"""Token log-probabilities and entropies from final hidden states, chunked over the sequence.

The naive path materialises logits z = h W of shape [B, T, V] in float32 (2 GiB per
sequence row at T = 16k, V = 32k) and keeps them, plus the softmax, alive for the
backward pass. Here the sequence is cut into chunks of `chunk_size` positions; for each
chunk (one `lax.map` step) the [B, c, V] logits are formed, reduced to

    log pi(y_t) = z_{t, y_t} - logsumexp_v z_{t, v}
    H_t         = -sum_v p_{t, v} log p_{t, v},   log p_t = z_t - logsumexp_v z_{t, v}

and dropped. The chunk body is wrapped in `jax.checkpoint` with nothing saved, so the
backward pass recomputes each chunk's logits instead of storing them: peak memory is
O(B c V) in both directions instead of O(B T V) (the same idea as the "chunked / fused
cross-entropy" of Liger-Kernel, Hsu et al. 2024, arXiv 2410.10989, and of Rabe & Staats
2021, arXiv 2112.05682, for attention). All reductions are float32 whatever the dtype of
`hidden` and `unembed` (the matmul accumulates in float32).

Use with `Transformer(..., return_hidden=True, compute_logits=False)` and
`unembedding_matrix(params, config)`; `model_token_logprobs` does both.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from arl.models.transformer import Transformer, unembedding_matrix


def _check(hidden, unembed, targets, chunk_size):
    fn = "chunked_token_logprobs"
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    hidden, unembed, targets = jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(targets)
    if hidden.ndim != 3:
        raise ValueError(f"{fn}: hidden must be [B, T, D], got shape {hidden.shape}")
    if unembed.ndim != 2 or unembed.shape[0] != hidden.shape[-1]:
        raise ValueError(f"{fn}: unembed must be [D, V] with D={hidden.shape[-1]}, got shape "
                         f"{unembed.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"{fn}: targets must be [B, T]={hidden.shape[:2]}, got shape "
                         f"{targets.shape}")
    for name, x in (("hidden", hidden), ("unembed", unembed)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be floating, got {x.dtype}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{fn}: targets must be integer token ids, got {targets.dtype}")
    return hidden, unembed, targets


def _chunk_stats(hidden_chunk, unembed, target_chunk):
    """[B, c, D], [D, V], [B, c] -> (log-prob, entropy), each float32 [B, c]."""
    logits = jnp.einsum("bcd,dv->bcv", hidden_chunk, unembed.astype(hidden_chunk.dtype),
                        preferred_element_type=jnp.float32)
    log_normaliser = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, target_chunk[..., None], axis=-1)[..., 0]
    log_probs = logits - log_normaliser[..., None]
    # -sum p log p (not lse - sum p z): no cancellation between two large numbers when
    # the distribution is peaked, and never negative.
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return chosen - log_normaliser, entropy


def chunked_token_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array,
                           chunk_size: int = 256) -> tuple[jax.Array, jax.Array]:
    """(log pi(targets) f32 [B, T], entropy f32 [B, T]) of logits `hidden @ unembed`,
    never holding more than [B, chunk_size, V] logits (forward and backward).

    Args:
      hidden: [B, T, D] final (normed) hidden states, any float dtype.
      unembed: [D, V] output projection (`unembedding_matrix`).
      targets: int [B, T] ids in [0, V) whose log-probability is wanted at each position
        (for next-token log-probs pass hidden[:, :-1] and tokens[:, 1:]).
      chunk_size: positions per chunk (static); T need not be a multiple (the tail
        chunk is zero-padded and the padding dropped).

    Equal to `token_logprobs(hidden @ unembed, targets)` and `entropy(...)` up to float32
    summation order, gradients included.
    """
    hidden, unembed, targets = _check(hidden, unembed, targets, chunk_size)
    batch, length, width = hidden.shape
    chunk_size = min(chunk_size, length)
    num_chunks = -(-length // chunk_size)
    padded = num_chunks * chunk_size
    if padded != length:
        hidden = jnp.pad(hidden, ((0, 0), (0, padded - length), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padded - length)))
    targets = jnp.clip(targets.astype(jnp.int32), 0, unembed.shape[1] - 1)
    # [n, B, c, ...]: lax.map runs over the leading chunk axis.
    hidden_chunks = hidden.reshape(batch, num_chunks, chunk_size, width).swapaxes(0, 1)
    target_chunks = targets.reshape(batch, num_chunks, chunk_size).swapaxes(0, 1)
    body = jax.checkpoint(lambda xs: _chunk_stats(xs[0], unembed, xs[1]),
                          policy=jax.checkpoint_policies.nothing_saveable)
    logp, ent = jax.lax.map(body, (hidden_chunks, target_chunks))
    logp = logp.swapaxes(0, 1).reshape(batch, padded)[:, :length]
    ent = ent.swapaxes(0, 1).reshape(batch, padded)[:, :length]
    chex.assert_shape([logp, ent], (batch, length))
    return logp, ent


def model_token_logprobs(model: Transformer, params, tokens: jax.Array,
                         chunk_size: int = 256, temperature: float = 1.0, *,
                         attention_mask=None, positions=None
                         ) -> tuple[jax.Array, jax.Array]:
    """Next-token (log-prob, entropy) of `tokens` [B, T] under `model`, chunked, of the
    tempered distribution softmax(z / temperature) (the rollout's sampling distribution).

    Returns float32 [B, T] arrays aligned with `tokens`: entry t > 0 is about token t
    given tokens < t; entry 0 (no context) is 0. Same convention as the train step's
    `token_logprobs(logits[:, :-1], tokens[:, 1:])` shifted right by one.
    attention_mask / positions: passed to the model (`Transformer.__call__`), e.g. to
    score left-padded rows. Entry t is read from the output at t - 1, so it is
    meaningful only where both t and t - 1 are real tokens: with left or right padding,
    every real token but the row's first.
    """
    if not temperature > 0:
        raise ValueError(f"model_token_logprobs: temperature must be > 0, got {temperature}")
    out = model.apply({"params": params}, tokens, return_hidden=True, compute_logits=False,
                      attention_mask=attention_mask, positions=positions)
    # (h W) / tau == h (W / tau): scaling the [D, V] matrix is cheaper than the logits.
    unembed = unembedding_matrix(params, model.config).astype(jnp.float32) / temperature
    logp, ent = chunked_token_logprobs(out.hidden[:, :-1], unembed, tokens[:, 1:], chunk_size)
    zeros = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([zeros, logp], axis=1), jnp.concatenate([zeros, ent], axis=1)

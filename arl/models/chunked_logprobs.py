"""Token log-probabilities and entropies from final hidden states, chunked over the sequence.

The naive path materialises logits z = h W of shape [B, T, V] in float32 (2 GiB per
sequence row at T = 16k, V = 32k) and keeps them, plus the softmax, alive for the
backward pass. Here the sequence is cut into chunks of `chunk_size` positions; for each
chunk (one `lax.map` step) the [B, c, V] logits are formed, reduced to

    log pi(y_t) = z_{t, y_t} - logsumexp_v z_{t, v}
    H_t         = -sum_v p_{t, v} log p_{t, v},   log p_t = z_t - logsumexp_v z_{t, v}

and dropped. The backward pass (a custom VJP) recomputes each chunk's logits instead of
storing them and accumulates the output matrix's gradient in float32: peak memory is
O(B c V) in both directions instead of O(B T V) (the same idea as the "chunked / fused
cross-entropy" of Liger-Kernel, Hsu et al. 2024, arXiv 2410.10989, and of Rabe & Staats
2021, arXiv 2112.05682, for attention). All reductions are float32 whatever the dtype of
`hidden` and `unembed` (the matmul accumulates in float32).

Use with `Transformer(..., return_hidden=True, compute_logits=False)` and
`output_matrix(params, config)` (or `unembedding_matrix`); `model_token_logprobs` does
both.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from arl.models.transformer import Transformer, output_matrix


def _check(hidden, unembed, targets, chunk_size, vocab_major):
    fn = "chunked_token_logprobs"
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    hidden, unembed, targets = jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(targets)
    if hidden.ndim != 3:
        raise ValueError(f"{fn}: hidden must be [B, T, D], got shape {hidden.shape}")
    if not isinstance(vocab_major, bool):
        raise ValueError(f"{fn}: vocab_major must be True or False, got {vocab_major!r}")
    width_axis, layout = (1, "[V, D]") if vocab_major else (0, "[D, V]")
    if unembed.ndim != 2 or unembed.shape[width_axis] != hidden.shape[-1]:
        raise ValueError(f"{fn}: unembed must be {layout} with D={hidden.shape[-1]} "
                         f"(vocab_major={vocab_major}), got shape {unembed.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"{fn}: targets must be [B, T]={hidden.shape[:2]}, got shape "
                         f"{targets.shape}")
    for name, x in (("hidden", hidden), ("unembed", unembed)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be floating, got {x.dtype}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{fn}: targets must be integer token ids, got {targets.dtype}")
    return hidden, unembed, targets


# Einsum subscripts of the output matrix: [D, V], or [V, D] (`vocab_major`: a tied
# embedding table read as it is stored, with no transposed copy of it).
_MATRIX = {False: "dv", True: "vd"}


def _chunk_log_probs(hidden_chunk, weights, temperature, vocab_major):
    """[B, c, D], [D, V] (or [V, D]) -> float32 [B, c, V] log-softmax of (h W) / tau."""
    logits = jnp.einsum(f"bcd,{_MATRIX[vocab_major]}->bcv", hidden_chunk, weights,
                        preferred_element_type=jnp.float32) / temperature
    return logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def _chunk_stats(log_probs, target_chunk):
    """float32 [B, c, V] log-probs -> (log-prob of the targets, entropy), each [B, c]."""
    chosen = jnp.take_along_axis(log_probs, target_chunk[..., None], axis=-1)[..., 0]
    # -sum p log p (not lse - sum p z): no cancellation between two large numbers when
    # the distribution is peaked, and never negative.
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return chosen, entropy


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_stats(hidden_chunks, unembed, target_chunks, temperature, vocab_major):
    """[n, B, c, D], [D, V] (or [V, D]), int [n, B, c], float32 [] -> (log-prob,
    entropy) [n, B, c]."""
    weights = unembed.astype(hidden_chunks.dtype)
    return jax.lax.map(
        lambda xs: _chunk_stats(_chunk_log_probs(xs[0], weights, temperature, vocab_major),
                                xs[1]),
        (hidden_chunks, target_chunks))


def _chunked_stats_forward(hidden_chunks, unembed, target_chunks, temperature, vocab_major):
    out = _chunked_stats(hidden_chunks, unembed, target_chunks, temperature, vocab_major)
    return out, (hidden_chunks, unembed, target_chunks, temperature)


def _chunked_stats_backward(vocab_major, residuals, cotangents):
    """Recomputes each chunk's log-probs and accumulates the [D, V] (or, `vocab_major`,
    [V, D]) gradient over the chunks in float32 (z = h W / tau, log p = z - lse, H = -sum p log p):

        d z_j = g_logp (1[j = y] - p_j) - g_H p_j (log p_j + H),
        d h = (d z / tau) W^T,   d W = sum over chunks of h^T (d z / tau).
    """
    hidden_chunks, unembed, target_chunks, temperature = residuals
    d_logp, d_entropy = cotangents
    weights = unembed.astype(hidden_chunks.dtype)
    matrix = _MATRIX[vocab_major]
    vocab = unembed.shape[0 if vocab_major else 1]

    def chunk(d_weights, xs):
        hidden_chunk, target_chunk, g_logp, g_entropy = xs
        log_probs = _chunk_log_probs(hidden_chunk, weights, temperature, vocab_major)
        probs = jnp.exp(log_probs)
        entropy = -jnp.sum(probs * log_probs, axis=-1, keepdims=True)
        chosen = jnp.arange(vocab) == target_chunk[..., None]
        d_logits = (g_logp[..., None] * (chosen - probs)
                    - g_entropy[..., None] * probs * (log_probs + entropy)) / temperature
        d_hidden = jnp.einsum(f"bcv,{matrix}->bcd", d_logits.astype(weights.dtype), weights,
                              preferred_element_type=jnp.float32)
        d_weights = d_weights + jnp.einsum(
            f"bcd,bcv->{matrix}", hidden_chunk, d_logits.astype(hidden_chunk.dtype),
            preferred_element_type=jnp.float32)
        return d_weights, d_hidden.astype(hidden_chunk.dtype)

    d_weights, d_hidden = jax.lax.scan(
        chunk, jnp.zeros(unembed.shape, jnp.float32),
        (hidden_chunks, target_chunks, d_logp, d_entropy))
    return d_hidden, d_weights.astype(unembed.dtype), None, None


_chunked_stats.defvjp(_chunked_stats_forward, _chunked_stats_backward)


def chunked_token_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array,
                           chunk_size: int = 256, temperature=1.0, *,
                           vocab_major: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log pi(targets) f32 [B, T], entropy f32 [B, T]) of logits
    `(hidden @ unembed) / temperature`, never holding more than [B, chunk_size, V]
    logits (forward and backward).

    Args:
      hidden: [B, T, D] final (normed) hidden states, any float dtype.
      unembed: [D, V] output projection (`unembedding_matrix`), or [V, D] with
        `vocab_major` (`output_matrix`).
      targets: int [B, T] ids in [0, V) whose log-probability is wanted at each position
        (for next-token log-probs pass hidden[:, :-1] and tokens[:, 1:]).
      chunk_size: positions per chunk (static); T need not be a multiple (the tail
        chunk is zero-padded and the padding dropped).
      temperature: divides the logits (a positive scalar; not differentiated).
      vocab_major: `unembed` is given as [V, D] (a tied embedding table as stored): the
        products read it in that layout and its gradient comes out [V, D], with no
        transposed copy of the matrix or of its float32 gradient.

    Equal to `token_logprobs(hidden @ unembed / temperature, targets)` (`unembed.T` when
    `vocab_major`) and
    `entropy(...)` up to float32 summation order, gradients included. The backward pass
    (a custom VJP) recomputes each chunk's logits and accumulates the gradient of
    `unembed` over the chunks in float32; `unembed` is read in `hidden`'s dtype and never
    copied to float32 (for a bfloat16 model, one [D, V] float32 buffer less than autodiff
    of a float32 matrix).
    """
    hidden, unembed, targets = _check(hidden, unembed, targets, chunk_size, vocab_major)
    batch, length, width = hidden.shape
    chunk_size = min(chunk_size, length)
    num_chunks = -(-length // chunk_size)
    padded = num_chunks * chunk_size
    if padded != length:
        hidden = jnp.pad(hidden, ((0, 0), (0, padded - length), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padded - length)))
    vocab = unembed.shape[0 if vocab_major else 1]
    targets = jnp.clip(targets.astype(jnp.int32), 0, vocab - 1)
    # [n, B, c, ...]: lax.map runs over the leading chunk axis.
    hidden_chunks = hidden.reshape(batch, num_chunks, chunk_size, width).swapaxes(0, 1)
    target_chunks = targets.reshape(batch, num_chunks, chunk_size).swapaxes(0, 1)
    logp, ent = _chunked_stats(hidden_chunks, unembed, target_chunks,
                               jnp.asarray(temperature, jnp.float32), vocab_major)
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
    matrix, vocab_major = output_matrix(params, model.config)
    logp, ent = chunked_token_logprobs(out.hidden[:, :-1], matrix, tokens[:, 1:], chunk_size,
                                       temperature, vocab_major=vocab_major)
    zeros = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([zeros, logp], axis=1), jnp.concatenate([zeros, ent], axis=1)

"""Helpers shared by the token-environment tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arl.envs.base import TokenChunk


def corrupted_turns(key, oracle: TokenChunk, *, vocab_size: int, garbage_prob: float
                    ) -> TokenChunk:
    """Fuzz actions [B, L] from the oracle's: even rows are garbage ids (some outside the
    vocabulary) with random lengths (some out of range); odd rows are the oracle's turns
    with each id replaced by garbage with probability `garbage_prob` and 20 % of the
    lengths replaced by random ones."""
    batch, size = oracle.tokens.shape
    k_tok, k_len, k_mask, k_cut = jax.random.split(key, 4)
    garbage = jax.random.randint(k_tok, (batch, size), -3, vocab_size + 3)
    lengths = jax.random.randint(k_len, (batch,), -2, size + 3)
    mixed = jnp.where(jax.random.bernoulli(k_mask, garbage_prob, (batch, size)), garbage,
                      oracle.tokens)
    cut = jnp.where(jax.random.bernoulli(k_cut, 0.2, (batch,)), lengths, oracle.length)
    use_garbage = (jnp.arange(batch) % 2) == 0
    return TokenChunk(jnp.where(use_garbage[:, None], garbage, mixed),
                      jnp.where(use_garbage, lengths, cut))

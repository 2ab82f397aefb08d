"""Randomness keyed by episode, not by batch row or time.

An episode's task comes from its group's reset key and every draw it makes (the policy's
tokens, the environment's steps) from its own episode key, the turn number and the token
index. Neither depends on which row plays the episode, on the other rows, or on when it
is played, so a lockstep rollout (`arl.rollout.rollout`) and a slot-scheduled one
(`arl.rollout.slots`) play the same episodes from the same key.

    group g's reset key:   fold_in(reset_key, g)
    episode e's key:       fold_in(turns_key, e)
    turn k of episode e:   fold_in(fold_in(episode_key, k), 0) for its tokens (token t's
                           noise from fold_in(that, t), `arl.models.sampling.row_noise`),
                           fold_in(fold_in(episode_key, k), 1) for the env's step
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_ACTION, _STEP = 0, 1


def is_batch(key: jax.Array) -> bool:
    """Whether `key` is a batch of keys ([B] typed keys or [B, 2] raw uint32 keys)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim >= 1
    return key.ndim >= 2


def numbered(key: jax.Array, numbers: jax.Array) -> jax.Array:
    """`fold_in(key, n)` for every n of the int array `numbers`: keys [len(numbers)]."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, numbers)


def group_reset_keys(reset_key: jax.Array, num_tasks: int, group_size: int) -> jax.Array:
    """Reset keys of `num_tasks * group_size` episodes: group g's members share
    `fold_in(reset_key, g)`."""
    keys = numbered(reset_key, jnp.arange(num_tasks, dtype=jnp.uint32))
    return jnp.repeat(keys, group_size, axis=0)


def episode_keys(turns_key: jax.Array, num_episodes: int) -> jax.Array:
    """Keys of episodes 0 .. num_episodes - 1: `fold_in(turns_key, e)`."""
    return numbered(turns_key, jnp.arange(num_episodes, dtype=jnp.uint32))


def turn_keys(keys: jax.Array, turn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(action keys, env-step keys), [B] each, of turn `turn[b]` of the episodes whose
    keys are `keys` [B]."""
    per_turn = jax.vmap(jax.random.fold_in)(keys, jnp.asarray(turn).astype(jnp.uint32))
    return (jax.vmap(jax.random.fold_in, in_axes=(0, None))(per_turn, _ACTION),
            jax.vmap(jax.random.fold_in, in_axes=(0, None))(per_turn, _STEP))

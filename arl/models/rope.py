"""Rotary position embedding (Su et al. 2021, "RoFormer", arXiv 2104.09864) in the
"rotate-half" layout of Hugging Face Llama / Qwen2: for frequencies
f_i = theta^(-2i/head_dim), i < head_dim/2,

    x' = x * cos(p f) + rotate_half(x) * sin(p f),   rotate_half([x1, x2]) = [-x2, x1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype
                ) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, 1, head_dim] of the rotary angles at `positions` int [B, T],
    rotate-half layout, in `dtype`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


# Largest sequence whose RoPE tables (sequence x head_dim / 2 elements each) are built as
# constants of the compiled program; a longer one computes them in the program.
CONSTANT_ROPE_ELEMENTS = 1 << 20


def constant_rope_tables(seq_len: int, head_dim: int, theta: float, dtype
                         ) -> tuple[jax.Array, jax.Array] | None:
    """`rope_tables` at positions 0..seq_len-1 as host constants [1, T, 1, head_dim], or
    None for a sequence above `CONSTANT_ROPE_ELEMENTS`.

    The angles are float32 products, as in the program (and in Hugging Face's
    implementation); their cos and sin are evaluated in float64 and rounded once.
    """
    if seq_len * head_dim // 2 > CONSTANT_ROPE_ELEMENTS:
        return None
    inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    angles = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq  # [T, D/2] float32
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)[None, :, None]
    return (jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype))


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, D] rotated by the `rope_tables` of its positions."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding, rotate-half layout. x [B, T, N, D], positions int [B, T]."""
    return rotate(x, *rope_tables(positions, x.shape[-1], theta, x.dtype))

"""Rotary position embedding (Su et al. 2021, "RoFormer", arXiv 2104.09864) in the
"rotate-half" layout of Hugging Face Llama / Qwen2: for frequencies
f_i = theta^(-2i/head_dim), i < head_dim/2,

    x' = x * cos(p f) + rotate_half(x) * sin(p f),   rotate_half([x1, x2]) = [-x2, x1].

Llama 3.1+ scale the frequencies for a longer context (`Llama3RopeScaling`, config.json
`rope_scaling: {"rope_type": "llama3", ...}`; Meta's reference and transformers'
`_compute_llama3_parameters`): with wavelength w_i = 2 pi / f_i and the original context
C, low / high frequency factors l / h and factor s,

    f_i' = f_i                          if w_i < C / h      (high frequencies kept)
    f_i' = f_i / s                      if w_i > C / l      (low frequencies slowed)
    f_i' = (1 - a) f_i / s + a f_i      otherwise, a = (C / w_i - l) / (h - l)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """The "llama3" RoPE frequency scaling (module docstring); hashable, so it can sit in
    a `TransformerConfig`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not (self.factor > 0 and self.low_freq_factor > 0
                and self.high_freq_factor > self.low_freq_factor
                and self.original_max_position_embeddings >= 1):
            raise ValueError(f"Llama3RopeScaling needs factor > 0, 0 < low_freq_factor < "
                             f"high_freq_factor and original_max_position_embeddings >= 1, "
                             f"got {self}")


def scaled_inverse_frequencies(head_dim: int, theta: float,
                               scaling: Llama3RopeScaling) -> np.ndarray:
    """float32 [head_dim / 2]: the frequencies f_i' of `scaling` (module docstring),
    computed in float64 and rounded once."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    context = float(scaling.original_max_position_embeddings)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    slowed = np.where(wavelength > context / low, inv_freq / scaling.factor, inv_freq)
    blend = (context / wavelength - low) / (high - low)
    smoothed = (1 - blend) * slowed / scaling.factor + blend * slowed
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return np.where(medium, smoothed, slowed).astype(np.float32)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype,
                scaling: Llama3RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, 1, head_dim] of the rotary angles at `positions` int [B, T],
    rotate-half layout, in `dtype` (frequencies scaled by `scaling` if given)."""
    if scaling is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    else:
        inv_freq = jnp.asarray(scaled_inverse_frequencies(head_dim, theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


# Largest sequence whose RoPE tables (sequence x head_dim / 2 elements each) are built as
# constants of the compiled program; a longer one computes them in the program.
CONSTANT_ROPE_ELEMENTS = 1 << 20


def constant_rope_tables(seq_len: int, head_dim: int, theta: float, dtype,
                         scaling: Llama3RopeScaling | None = None
                         ) -> tuple[jax.Array, jax.Array] | None:
    """`rope_tables` at positions 0..seq_len-1 as host constants [1, T, 1, head_dim], or
    None for a sequence above `CONSTANT_ROPE_ELEMENTS`.

    The angles are float32 products, as in the program (and in Hugging Face's
    implementation); their cos and sin are evaluated in float64 and rounded once.
    """
    if seq_len * head_dim // 2 > CONSTANT_ROPE_ELEMENTS:
        return None
    if scaling is None:
        inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    else:
        inv_freq = scaled_inverse_frequencies(head_dim, theta, scaling)
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

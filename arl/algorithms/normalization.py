"""Masked whitening of advantages (or any statistic)."""

from __future__ import annotations


import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v

WHITEN_EPS = 1e-8


def whiten(x, mask, *, shift_mean: bool = True) -> jax.Array:
    """Whitens `x` over the entries where `mask` is true.

    .. math::
        \\mu = \\frac{\\sum_i m_i x_i}{\\sum_i m_i}, \\quad
        \\sigma^2 = \\frac{\\sum_i m_i (x_i - \\mu)^2}{\\sum_i m_i - 1}, \\quad
        y_i = m_i \\cdot \\frac{x_i - \\mu}{\\sqrt{\\sigma^2 + 10^{-8}}}

    The variance is unbiased (Bessel's correction), as in the advantage whitening of
    PPO-style RLHF (Ouyang et al. 2022; REINFORCE++, Hu 2025, arXiv 2501.03262). With
    `shift_mean=False` the mean is added back after scaling (scale only, keep the sign
    structure of the raw values), matching `masked_whiten(shift_mean=False)` in TRL/verl.

    Degenerate input is safe: fewer than two masked entries give variance 0 (the single
    entry whitens to 0); no masked entries give all zeros.

    Args:
        x: array of any shape, any floating dtype (computed in float32).
        mask: array of the shape of `x`; bool or 0/1.
        shift_mean: subtract the mean (True) or keep it (False).

    Returns:
        float32 array of the shape of `x`, zero where `mask` is 0.
    """
    fn = "whiten"
    x = v.floating(fn, "x", x)
    mask = v.boolean(fn, "mask", mask)
    v.same_shape(fn, "mask", mask, "x", x.shape)
    return _whiten(x, mask, shift_mean)


def _whiten(x, mask, shift_mean):
    x = jnp.where(mask, x, 0.0)
    count = jnp.sum(mask, dtype=x.dtype)
    mean = jnp.sum(x) / jnp.maximum(count, 1.0)
    centred = jnp.where(mask, x - mean, 0.0)
    var = jnp.sum(centred * centred) / jnp.maximum(count - 1.0, 1.0)
    whitened = centred * jax.lax.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(mask, whitened, 0.0)

"""Explicit reduction of per-token losses to a scalar (loss aggregation modes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v

AGGREGATIONS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def aggregate(per_token, mask, mode: str, *, norm=None) -> jax.Array:
    """Reduces a `[B, T]` per-token quantity `L` under the mask `m` to a scalar.

    * ``token-mean``: sum(m L) / sum(m) (every agent token weighs the same; DAPO,
      Yu et al. 2025, arXiv 2503.14476).
    * ``token-sum``: sum(m L).
    * ``seq-mean-token-sum``: mean over sequences of sum_t m L.
    * ``seq-mean-token-mean``: mean over sequences of (sum_t m L / sum_t m) (the
      original GRPO, Shao et al. 2024).
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / N for a constant N
      (`norm`, default T, e.g. the maximum response length; Dr.GRPO, Liu et al. 2025,
      arXiv 2503.20783).

    Means over sequences count only rows with at least one agent token. Example:
    L = [[1, 2, 3, 4], [5, 6, 0, 0]], m = [[1, 1, 1, 1], [1, 1, 0, 0]] gives 3.5, 21,
    10.5, 4.0 and (N = 4) 2.625. An all-masked batch gives 0.

    Args:
        per_token: [B, T] float.
        mask: [B, T] bool or 0/1.
        mode: one of `AGGREGATIONS`.
        norm: the constant N for ``seq-mean-token-sum-norm`` (positive scalar); only
            allowed with that mode.

    Returns:
        float32 scalar.
    """
    fn = "aggregate"
    mode = v.choice(fn, "aggregation mode", mode, AGGREGATIONS)
    per_token = v.floating(fn, "per_token", per_token, rank=2, layout="[B, T]")
    mask = v.boolean(fn, "mask", mask, rank=2, layout="[B, T]")
    v.same_shape(fn, "mask", mask, "per_token", per_token.shape)
    if norm is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"{fn}: `norm` is only used by mode 'seq-mean-token-sum-norm', "
                         f"got mode {mode!r}.")
    masked = jnp.where(mask, per_token, 0.0)
    if mode == "token-mean":
        return jnp.sum(masked) / jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0)
    if mode == "token-sum":
        return jnp.sum(masked)
    row_count = jnp.sum(mask, axis=-1, dtype=jnp.float32)
    row_sum = jnp.sum(masked, axis=-1)
    rows = row_count > 0
    num_rows = jnp.maximum(jnp.sum(rows, dtype=jnp.float32), 1.0)
    if mode == "seq-mean-token-mean":
        return jnp.sum(row_sum / jnp.maximum(row_count, 1.0)) / num_rows
    seq_mean_token_sum = jnp.sum(row_sum) / num_rows
    if mode == "seq-mean-token-sum":
        return seq_mean_token_sum
    if norm is None:
        norm = per_token.shape[-1]
    norm = v.scalar(fn, "norm", norm, low=0.0, low_open=True)
    return seq_mean_token_sum / norm

"""Segment statistics shared by the group kernels, filters and process advantages
(package-internal): input checks, per-segment moments, gathering per-segment values back
to rows."""

from __future__ import annotations


import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v


def check_group_inputs(fn, scores, group_ids, num_groups, valid):
    """Checked (scores [N], group_ids [N], num_groups, valid [N]); ids out of range are
    invalid."""
    scores = v.floating(fn, "scores", scores, rank=1, layout="[N]")
    group_ids = v.integer(fn, "group_ids", group_ids, rank=1, layout="[N]")
    v.same_shape(fn, "group_ids", group_ids, "scores", scores.shape)
    num_groups = v.positive_int(fn, "num_groups", num_groups)
    valid = valid_mask(fn, valid, scores.shape)
    valid = valid & (group_ids >= 0) & (group_ids < num_groups)
    return scores, group_ids, num_groups, valid


def valid_mask(fn, valid, shape):
    """The checked `valid` argument [N] (all true when None)."""
    if valid is None:
        return jnp.ones(shape, bool)
    valid = v.boolean(fn, "valid", valid, rank=1, layout="[N]")
    v.same_shape(fn, "valid", valid, "scores", shape)
    return valid


def segment_moments(scores, segment_ids, num_segments, valid):
    """(mean, Bessel std, count, all-equal-or-small) per segment; two-pass variance."""
    ids = jnp.where(valid, segment_ids, num_segments)  # out of range: dropped by segment ops
    # Stacked columns: one scatter per pass instead of one per statistic.
    sums = jax.ops.segment_sum(
        jnp.stack([valid.astype(scores.dtype), jnp.where(valid, scores, 0.0)], axis=-1),
        ids, num_segments)
    countf, total = sums[:, 0], sums[:, 1]
    count = countf.astype(jnp.int32)
    mean = total / jnp.maximum(countf, 1.0)
    centred = jnp.where(valid, scores - mean[jnp.clip(segment_ids, 0, num_segments - 1)],
                        0.0)
    sq = jax.ops.segment_sum(centred * centred, ids, num_segments)
    var = sq / jnp.maximum(countf - 1.0, 1.0)
    # sqrt'(0) is infinite: a constant or singleton segment would send inf * 0 = NaN into
    # the gradient of every score (segment ops mix the rows). Differentiate sqrt only
    # where the variance is positive; the values are the same.
    positive = var > 0
    std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)
    extremes = jax.ops.segment_max(
        jnp.stack([jnp.where(valid, scores, -jnp.inf), jnp.where(valid, -scores, -jnp.inf)],
                  axis=-1), ids, num_segments)
    degenerate = (count < 2) | (extremes[:, 0] <= -extremes[:, 1])
    return mean, std, count, degenerate


def divide_where(numerator, denominator, keep):
    """`numerator / denominator` where `keep` and the denominator is non-zero, else 0.

    The double where: the division itself never sees a zero denominator, so a zero-variance
    segment at eps = 0 sends 0, not 0 * inf = NaN, into the gradient of every score."""
    usable = keep & (denominator != 0)
    return jnp.where(usable, numerator / jnp.where(usable, denominator, 1.0), 0.0)


def gather(per_group, ids, num_groups):
    """Each row's value of its segment (ids clipped into range)."""
    return per_group[jnp.clip(ids, 0, num_groups - 1)]

"""Trajectory filters and the turn-horizon curriculum (static shapes: keep-masks).

Filters never change shapes: they return a boolean keep-mask over the N trajectories,
to be and-ed into `valid`/the loss mask. Schedules of scalar coefficients (learning
rate, KL or SFT weights) are optax schedules (`optax.linear_schedule` etc.), not here.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v
from arl.algorithms._segments import check_group_inputs, gather, segment_moments


def starpo_keep_mask(scores, group_ids, *, num_groups: int, keep_fraction=0.25,
                     valid=None) -> jax.Array:
    """StarPO-S variance filter (RAGEN, Wang et al. 2025, arXiv 2504.20073).

    Keeps the trajectories of the top-p fraction of groups ranked by the (Bessel) std
    of their valid scores: high-variance groups carry the most learning signal, while
    low-variance ones drive the "echo trap" collapse. With P non-empty groups,

    .. math:: k = \\max(1, \\lfloor p \\cdot P \\rfloor)

    groups are kept (ties broken by lower group id; empty groups never kept).
    `keep_fraction` is static (a Python float in (0, 1]).

    Args:
        scores: [N] float.
        group_ids: [N] int in [0, num_groups).
        num_groups: static G.
        keep_fraction: p in (0, 1].
        valid: [N] optional bool.

    Returns:
        [N] bool keep-mask (false on invalid trajectories).
    """
    fn = "starpo_keep_mask"
    scores, group_ids, num_groups, valid = check_group_inputs(fn, scores, group_ids, num_groups, valid)
    if not v.is_concrete_number(keep_fraction) or not 0.0 < float(keep_fraction) <= 1.0:
        raise ValueError(f"{fn}: `keep_fraction` must be a Python float in (0, 1], got "
                         f"{keep_fraction!r}.")
    _, std, count, _ = segment_moments(scores, group_ids, num_groups, valid)
    present = count > 0
    num_present = jnp.sum(present, dtype=jnp.int32)
    num_keep = jnp.maximum(
        1, jnp.floor(float(keep_fraction) * num_present.astype(jnp.float32) + 1e-6)
        .astype(jnp.int32))
    order = jnp.argsort(jnp.where(present, -std, jnp.inf), stable=True)
    rank = jnp.zeros(num_groups, jnp.int32).at[order].set(
        jnp.arange(num_groups, dtype=jnp.int32))
    keep_group = present & (rank < num_keep)
    return valid & gather(keep_group, group_ids, num_groups)


def dapo_zero_variance_mask(scores, group_ids, *, num_groups: int, valid=None
                            ) -> jax.Array:
    """DAPO dynamic-sampling mask (Yu et al. 2025, arXiv 2503.14476).

    Drops the groups whose valid scores are all equal (all solved or all failed, which
    includes singleton groups): their group-relative advantage is 0 and they only dilute
    the batch. Keep = valid and the group's max score > its min score.

    Args:
        scores: [N] float.
        group_ids: [N] int in [0, num_groups).
        num_groups: static G.
        valid: [N] optional bool.

    Returns:
        [N] bool keep-mask.
    """
    scores, group_ids, num_groups, valid = check_group_inputs(
        "dapo_zero_variance_mask", scores, group_ids, num_groups, valid)
    _, _, _, degenerate = segment_moments(scores, group_ids, num_groups, valid)
    return valid & ~gather(degenerate, group_ids, num_groups)


def horizon_schedule(step, *, rounds: Sequence[int], every: int) -> jax.Array:
    """Interaction-horizon curriculum of ScalingInter-RL (AgentGym-RL, arXiv 2509.08755).

    .. math:: h(step) = rounds[\\min(\\lfloor step / K \\rfloor, len(rounds) - 1)]

    with K = `every`. The rollout always scans the largest horizon; episodes past h are
    truncated by mask. `step` may be traced (negative steps count as 0).

    Args:
        step: int scalar (Python or traced).
        rounds: non-empty static sequence of positive ints, e.g. (3, 6, 10).
        every: K, positive int.

    Returns:
        int32 scalar horizon.
    """
    fn = "horizon_schedule"
    rounds = tuple(rounds)
    if not rounds or any(isinstance(r, bool) or not isinstance(r, int) or r < 1
                         for r in rounds):
        raise ValueError(f"{fn}: `rounds` must be a non-empty sequence of positive ints, "
                         f"got {rounds!r}.")
    every = v.positive_int(fn, "every", every)
    step = v.integer(fn, "step", step, rank=0, layout="(scalar)")
    stage = jnp.clip(step // every, 0, len(rounds) - 1)
    return jnp.asarray(rounds, jnp.int32)[stage]

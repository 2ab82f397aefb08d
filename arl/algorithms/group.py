"""Group-relative advantages over trajectory groups given by ids (segment ops).

A batch holds N trajectories; `group_ids[i]` in `[0, num_groups)` names the group
(question / prompt) of trajectory i. Groups are ids, not a reshape: groups may have
different sizes and need not be contiguous, all under `jax.jit` with static shapes.
`valid[i]` false removes a trajectory from every statistic (padding, filtered rows); its
advantage is 0. Ids outside `[0, num_groups)` are treated as invalid.

A group is *degenerate* when it has fewer than two valid members or all its valid
scores are equal (exactly: max == min, so float round-off in the mean cannot turn a
constant group into a tiny non-zero signal). Degenerate groups give advantage 0.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v
from arl.algorithms._segments import (check_group_inputs, divide_where, gather,
                                     segment_moments, valid_mask)
from arl.algorithms.normalization import whiten


class GroupStatistics(NamedTuple):
    """Per-group statistics of the valid scores; every field is `[num_groups]` (a tuple,
    so a pytree without a dataclass library)."""

    mean: jax.Array  # float32; 0 for empty groups
    std: jax.Array  # float32, Bessel-corrected; 0 for groups with < 2 members
    count: jax.Array  # int32 number of valid members
    degenerate: jax.Array  # bool: count < 2 or all valid scores equal

    def degenerate_fraction(self) -> jax.Array:
        """Fraction of non-empty groups that are degenerate (0 if all are empty)."""
        present = self.count > 0
        num_present = jnp.sum(present, dtype=jnp.float32)
        num_degenerate = jnp.sum(self.degenerate & present, dtype=jnp.float32)
        return num_degenerate / jnp.maximum(num_present, 1.0)


def group_statistics(scores, group_ids, *, num_groups: int, valid=None) -> GroupStatistics:
    """Mean, Bessel-corrected std, count and degeneracy of each group's valid scores.

    .. math::
        n_g = \\sum_{i \\in g} v_i, \\quad \\mu_g = \\frac{1}{n_g}\\sum_{i\\in g} v_i s_i,
        \\quad \\sigma_g = \\sqrt{\\frac{\\sum_{i \\in g} v_i (s_i - \\mu_g)^2}{n_g - 1}}

    Args:
        scores: [N] float sequence scores (rewards).
        group_ids: [N] int group of each trajectory.
        num_groups: static number of groups G.
        valid: [N] optional bool; invalid trajectories are left out.

    Returns:
        `GroupStatistics` with `[G]` fields; `degenerate_fraction()` gives the metric.
    """
    scores, group_ids, num_groups, valid = check_group_inputs(
        "group_statistics", scores, group_ids, num_groups, valid)
    mean, std, count, degenerate = segment_moments(scores, group_ids, num_groups, valid)
    return GroupStatistics(mean=mean, std=std, count=count, degenerate=degenerate)


def group_advantages(scores, group_ids, *, num_groups: int, scale_by_std: bool = True,
                     eps: float = 1e-6, valid=None) -> jax.Array:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300).

    .. math:: A_i = \\frac{s_i - \\mu_{g(i)}}{\\sigma_{g(i)} + \\epsilon}

    with the Bessel-corrected group std. `scale_by_std=False` gives Dr.GRPO
    (Liu et al. 2025, arXiv 2503.20783): `A_i = s_i - mu_g(i)`. Degenerate groups
    (< 2 valid members, or all valid scores equal) and invalid trajectories give 0.

    Args:
        scores: [N] float.
        group_ids: [N] int in [0, num_groups).
        num_groups: static G.
        scale_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std.
        valid: [N] optional bool.

    Returns:
        [N] float32 advantages.
    """
    fn = "group_advantages"
    scores, group_ids, num_groups, valid = check_group_inputs(fn, scores, group_ids, num_groups, valid)
    eps = v.scalar(fn, "eps", eps, low=0.0)
    mean, std, _, degenerate = segment_moments(scores, group_ids, num_groups, valid)
    advantages = scores - gather(mean, group_ids, num_groups)
    keep = valid & ~gather(degenerate, group_ids, num_groups)
    if scale_by_std:
        return divide_where(advantages, gather(std, group_ids, num_groups) + eps, keep)
    return jnp.where(keep, advantages, 0.0)


def rloo_advantages(scores, group_ids, *, num_groups: int, valid=None) -> jax.Array:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

    .. math::
        A_i = s_i - \\frac{1}{n_g - 1}\\sum_{j \\in g, j \\ne i} s_j
            = \\frac{n_g}{n_g - 1}(s_i - \\mu_g)

    over the valid members of the group; 0 for singletons and invalid trajectories.

    Args:
        scores: [N] float.
        group_ids: [N] int in [0, num_groups).
        num_groups: static G.
        valid: [N] optional bool.

    Returns:
        [N] float32 advantages.
    """
    fn = "rloo_advantages"
    scores, group_ids, num_groups, valid = check_group_inputs(fn, scores, group_ids, num_groups, valid)
    mean, _, count, _ = segment_moments(scores, group_ids, num_groups, valid)
    n = gather(count, group_ids, num_groups).astype(jnp.float32)
    advantages = n / jnp.maximum(n - 1.0, 1.0) * (scores - gather(mean, group_ids,
                                                                   num_groups))
    return jnp.where(valid & (n >= 2), advantages, 0.0)


def reinforce_pp_advantages(scores, group_ids=None, *, num_groups: Optional[int] = None,
                            valid=None) -> jax.Array:
    """REINFORCE++ advantages (Hu 2025, arXiv 2501.03262).

    Without `group_ids`: the scores whitened over the (valid) batch,
    `A = whiten(s)`. With `group_ids` (REINFORCE++-baseline): subtract the group mean,
    then whiten over the batch, `A = whiten(s - mu_g(i))`. `whiten` uses the unbiased
    batch variance and eps 1e-8 under the square root.

    Args:
        scores: [N] float.
        group_ids: optional [N] int in [0, num_groups).
        num_groups: static G, required with `group_ids`.
        valid: [N] optional bool.

    Returns:
        [N] float32 advantages, 0 on invalid trajectories.
    """
    fn = "reinforce_pp_advantages"
    if group_ids is None:
        if num_groups is not None:
            raise ValueError(f"{fn}: `num_groups` given without `group_ids`.")
        scores = v.floating(fn, "scores", scores, rank=1, layout="[N]")
        valid = valid_mask(fn, valid, scores.shape)
        return whiten(scores, valid)
    if num_groups is None:
        raise ValueError(f"{fn}: `group_ids` needs the static `num_groups`.")
    scores, group_ids, num_groups, valid = check_group_inputs(fn, scores, group_ids, num_groups, valid)
    mean, _, _, _ = segment_moments(scores, group_ids, num_groups, valid)
    return whiten(scores - gather(mean, group_ids, num_groups), valid)


def env_advantages(scores, group_ids, env_ids, *, num_groups: int, num_envs: int,
                   eps: float = 1e-6, valid=None, centre_on_env_mean: bool = False
                   ) -> jax.Array:
    """ERPO environment-level relative advantages (AutoForge, arXiv 2512.22857).

    .. math::
        A_{ij} = \\frac{R_{ij} - \\mu_{g(ij)}}{\\sigma_{e(ij)} + \\epsilon}

    The mean is per group (question) and the Bessel-corrected std is pooled over all
    valid trajectories of the environment, so an easy environment's signal is not
    drowned by a hard one's. `centre_on_env_mean=True` centres on the environment mean
    instead: `A = (R - mu_env) / (sigma_env + eps)`. Environments with fewer than two
    valid trajectories or constant scores give 0; with group centring, degenerate
    groups give 0 as well. Each group is expected to lie in one environment.

    Args:
        scores: [N] float.
        group_ids: [N] int in [0, num_groups).
        env_ids: [N] int in [0, num_envs).
        num_groups: static G.
        num_envs: static number of environments E.
        eps: added to the environment std.
        valid: [N] optional bool.
        centre_on_env_mean: centre on the environment mean instead of the group mean.

    Returns:
        [N] float32 advantages, 0 on invalid trajectories.
    """
    fn = "env_advantages"
    scores, group_ids, num_groups, valid = check_group_inputs(fn, scores, group_ids, num_groups, valid)
    env_ids = v.integer(fn, "env_ids", env_ids, rank=1, layout="[N]")
    v.same_shape(fn, "env_ids", env_ids, "scores", scores.shape)
    num_envs = v.positive_int(fn, "num_envs", num_envs)
    eps = v.scalar(fn, "eps", eps, low=0.0)
    valid = valid & (env_ids >= 0) & (env_ids < num_envs)
    env_mean, env_std, _, env_degenerate = segment_moments(scores, env_ids, num_envs, valid)
    keep = valid & ~gather(env_degenerate, env_ids, num_envs)
    if centre_on_env_mean:
        centred = scores - gather(env_mean, env_ids, num_envs)
    else:
        mean, _, _, degenerate = segment_moments(scores, group_ids, num_groups, valid)
        centred = scores - gather(mean, group_ids, num_groups)
        keep = keep & ~gather(degenerate, group_ids, num_groups)
    return divide_where(centred, gather(env_std, env_ids, num_envs) + eps, keep)

"""Policy losses beside PPO's clipped token ratio: a sequence-level ratio (GSPO) and a
clipped importance weight that drops no token (CISPO).

Both take the arguments of `policy_loss` (`logp`, `old_logp`, `advantages` `[B]` or
`[B, T]`, the agent `mask`), return `(loss, metrics)` with `policy_loss`'s metric names
(`ratio_diagnostics`; `dual_clip_fraction` is 0), compute in float32, treat `old_logp`
and `advantages` as constants and give masked tokens zero loss and zero gradient, even
when their log-probs are -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v
from arl.algorithms.aggregation import AGGREGATIONS, aggregate
from arl.algorithms.losses import (LOG_RATIO_CLAMP, _broadcast_advantages, _token_inputs,
                                   ratio_diagnostics)

__all__ = ["cispo_policy_loss", "cispo_policy_loss_per_token", "gspo_policy_loss",
           "gspo_policy_loss_per_token"]


def _common_inputs(fn, logp, old_logp, advantages, mask, clip_low, clip_high):
    (logp, old_logp), mask = _token_inputs(fn, [("logp", logp), ("old_logp", old_logp)],
                                           mask)
    advantages = _broadcast_advantages(fn, advantages, logp.shape)
    clip_low = v.scalar(fn, "clip_low", clip_low, low=0.0, high=1.0)
    clip_high = v.scalar(fn, "clip_high", clip_high, low=0.0)
    old_logp = jax.lax.stop_gradient(old_logp)
    advantages = jax.lax.stop_gradient(jnp.where(mask, advantages, 0.0))
    logp = jnp.where(mask, logp, 0.0)  # padding's -inf never reaches the arithmetic
    log_ratio = jnp.where(mask, logp - old_logp, 0.0)
    return logp, log_ratio, advantages, mask, clip_low, clip_high


def _gspo_terms(fn, logp, old_logp, advantages, mask, clip_low, clip_high):
    logp, log_ratio, advantages, mask, clip_low, clip_high = _common_inputs(
        fn, logp, old_logp, advantages, mask, clip_low, clip_high)
    lengths = jnp.sum(mask, axis=1, dtype=jnp.float32)
    sequence_log_ratio = jnp.sum(log_ratio, axis=1) / jnp.maximum(lengths, 1.0)
    sequence_ratio = jnp.exp(jnp.clip(sequence_log_ratio, -LOG_RATIO_CLAMP,
                                      LOG_RATIO_CLAMP))
    # s_{i,t} = sg[s_i] * pi_t / sg[pi_t]: the value of s_i, the gradient of log pi_t.
    ratio = (jax.lax.stop_gradient(sequence_ratio)[:, None]
             * jnp.exp(logp - jax.lax.stop_gradient(logp)))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.where(mask, jnp.maximum(unclipped, clipped), 0.0)
    shown = jnp.broadcast_to(sequence_ratio[:, None], mask.shape)
    terms = dict(log_ratio=jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
                 ratio=shown,
                 clipped_low=mask & (advantages < 0) & (shown < 1.0 - clip_low),
                 clipped_high=mask & (advantages > 0) & (shown > 1.0 + clip_high),
                 dual_active=jnp.zeros_like(mask))
    return loss, mask, terms


def gspo_policy_loss_per_token(logp, old_logp, advantages, mask, *, clip_low=3e-4,
                               clip_high=4e-4) -> jax.Array:
    """GSPO: PPO's clipped surrogate on the sequence-level ratio (Zheng et al. 2025,
    "Group Sequence Policy Optimization", arXiv 2507.18071), in its GSPO-token form.

    .. math::
        s_i = \\exp\\Big(\\frac{1}{|y_i|}\\sum_{t \\in y_i}
              (\\log\\pi_t - \\log\\pi^{old}_t)\\Big), \\quad
        s_{i,t} = \\mathrm{sg}[s_i]\\,\\frac{\\pi_t}{\\mathrm{sg}[\\pi_t]}, \\quad
        L_{i,t} = \\max\\big(-A_{i,t} s_{i,t},\\;
                  -A_{i,t}\\,\\mathrm{clip}(s_{i,t}, 1-\\epsilon_{low}, 1+\\epsilon_{high})\\big)

    `|y_i|` counts the row's agent tokens (the mask), the mean log-ratio is clamped to
    +-20 before the exponential, and rows without agent tokens have `s_i = 1`. Every
    token of a row carries the value `s_i`, so the clip decides per sequence; the
    gradient of `s_{i,t}` is `s_i` times that of `log pi_t`. With sequence advantages
    `[B]` and `agg="seq-mean-token-mean"`, the loss and its gradient are GSPO's
    `-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)`; the paper's clip range is small (3e-4,
    4e-4) because `s_i` is a geometric mean of token ratios.

    Returns:
        [B, T] float32, zero where `mask` is 0.
    """
    loss, _, _ = _gspo_terms("gspo_policy_loss_per_token", logp, old_logp, advantages,
                             mask, clip_low, clip_high)
    return loss


def gspo_policy_loss(logp, old_logp, advantages, mask, *, clip_low=3e-4, clip_high=4e-4,
                     agg: str = "seq-mean-token-mean", norm=None):
    """GSPO's policy loss, aggregated, with diagnostics (`gspo_policy_loss_per_token`).

    Args:
        logp: [B, T] float log-probs under the current policy (differentiated).
        old_logp: [B, T] float log-probs under the behaviour policy.
        advantages: [B] or [B, T] float.
        mask: [B, T] agent mask.
        clip_low: epsilon_low of the sequence ratio, in [0, 1].
        clip_high: epsilon_high of the sequence ratio, >= 0.
        agg: aggregation mode, one of `AGGREGATIONS` ("seq-mean-token-mean" is GSPO's).
        norm: constant for 'seq-mean-token-sum-norm'.

    Returns:
        (loss, metrics): `policy_loss`'s metrics with `ratio_*` and the clip fractions
        taken over the sequence ratio `s_i` of each agent token; `approx_kl_*` over the
        token log-ratios.
    """
    fn = "gspo_policy_loss"
    agg = v.choice(fn, "aggregation mode", agg, AGGREGATIONS)
    per_token, mask, terms = _gspo_terms(fn, logp, old_logp, advantages, mask, clip_low,
                                         clip_high)
    return aggregate(per_token, mask, agg, norm=norm), ratio_diagnostics(terms, mask)


def _cispo_terms(fn, logp, old_logp, advantages, mask, clip_low, clip_high):
    logp, log_ratio, advantages, mask, clip_low, clip_high = _common_inputs(
        fn, logp, old_logp, advantages, mask, clip_low, clip_high)
    log_ratio = jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    loss = jnp.where(mask, -weight * advantages * logp, 0.0)
    terms = dict(log_ratio=log_ratio, ratio=ratio,
                 clipped_low=mask & (ratio < 1.0 - clip_low),
                 clipped_high=mask & (ratio > 1.0 + clip_high),
                 dual_active=jnp.zeros_like(mask))
    return loss, mask, terms


def cispo_policy_loss_per_token(logp, old_logp, advantages, mask, *, clip_low=1.0,
                                clip_high=0.28) -> jax.Array:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance weight
    (MiniMax-M1, MiniMax 2025, arXiv 2506.13585, eq. 4-5).

    .. math::
        r_t = \\exp(\\mathrm{clamp}(\\log\\pi_t - \\log\\pi^{old}_t, \\pm 20)), \\quad
        L_t = -\\mathrm{sg}\\big[\\mathrm{clip}(r_t, 1-\\epsilon_{low},
              1+\\epsilon_{high})\\big]\\, A_t \\log\\pi_t

    Unlike PPO's clip, which zeroes the gradient of a token whose ratio left the range,
    every token keeps its gradient `-w_t A_t grad log pi_t`; the clip only bounds the
    weight `w_t`. The paper sets no lower bound (a large epsilon_low): `clip_low=1`
    here; its epsilon_high is tuned and unpublished, 0.28 is our default.

    Returns:
        [B, T] float32, zero where `mask` is 0.
    """
    loss, _, _ = _cispo_terms("cispo_policy_loss_per_token", logp, old_logp, advantages,
                              mask, clip_low, clip_high)
    return loss


def cispo_policy_loss(logp, old_logp, advantages, mask, *, clip_low=1.0, clip_high=0.28,
                      agg: str = "token-mean", norm=None):
    """CISPO's policy loss, aggregated, with diagnostics (`cispo_policy_loss_per_token`).

    Args:
        logp: [B, T] float log-probs under the current policy (differentiated).
        old_logp: [B, T] float log-probs under the behaviour policy.
        advantages: [B] or [B, T] float.
        mask: [B, T] agent mask.
        clip_low: epsilon_low of the importance weight, in [0, 1] (1: no lower bound).
        clip_high: epsilon_high of the importance weight, >= 0.
        agg: aggregation mode, one of `AGGREGATIONS` ("token-mean" is the paper's).
        norm: constant for 'seq-mean-token-sum-norm'.

    Returns:
        (loss, metrics): `policy_loss`'s metrics; the clip fractions count the agent
        tokens whose weight was clipped below (`r < 1 - eps_low`) or above
        (`r > 1 + eps_high`), whatever the advantage's sign.
    """
    fn = "cispo_policy_loss"
    agg = v.choice(fn, "aggregation mode", agg, AGGREGATIONS)
    per_token, mask, terms = _cispo_terms(fn, logp, old_logp, advantages, mask, clip_low,
                                          clip_high)
    return aggregate(per_token, mask, agg, norm=norm), ratio_diagnostics(terms, mask)

"""Off-policy corrections for samples drawn by an older (or numerically different) policy.

Three policies meet in an asynchronous update (Fu et al. 2025, AReaL, arXiv 2505.24298):

* pi_behave: the policy that sampled the tokens (the rollout's log-probs, `behaviour_logp`),
  possibly `k` parameter versions old, or computed by a different kernel (sampler vs
  trainer mismatch);
* pi_prox: the parameters at the start of this update (`prox_logp`, one forward pass
  before the first optimizer step, no gradient);
* pi_theta: the parameters being optimised (`logp`, differentiated).

A correction picks the reference of PPO's ratio and a constant per-token weight w:

    L_t = w_t * PPO_t(r_t = pi_theta / pi_ref, A_t),   w_t = stop_grad(shape(pi_prox / pi_behave))

=========== ============ ======================================================
correction  pi_ref       w_t
=========== ============ ======================================================
none        pi_behave    1 (synchronous: pi_behave is pi_prox)
bypass      pi_behave    1 (the lag is left to PPO's clip; verl one-step-off)
tis         pi_prox      min(pi_prox / pi_behave, C) per token (truncated IS)
icepop      pi_prox      pi_prox / pi_behave inside [low, high], else 0
decoupled   pi_prox      min(rho, C), rho per token, per sequence or geometric mean
=========== ============ ======================================================

TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (slime, verl). IcePop: Ling Team 2025, "Every Step Evolves" (Ring-1T,
arXiv 2510.18855). Decoupled PPO: Hilton et al. 2022 (arXiv 2110.00641), AReaL
(arXiv 2505.24298). `tis` is `decoupled` at token level, kept under the name its users
know.

Every PPO-family policy loss here is positively homogeneous in the advantage
(max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)) for w >= 0, likewise the dual clip), so
the weight can be applied by scaling the advantages: `weighted_advantages`, which keeps
any such loss unchanged otherwise. `decoupled_policy_loss_per_token` is the reference
form, w times the per-token PPO loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v
from arl.algorithms.losses import LOG_RATIO_CLAMP, policy_loss_per_token

__all__ = [
    "CORRECTIONS", "WEIGHT_LEVELS", "decoupled_policy_loss_per_token",
    "importance_log_weights", "needs_proximal", "off_policy_weights", "weighted_advantages",
]

CORRECTIONS = ("none", "bypass", "tis", "icepop", "decoupled")
WEIGHT_LEVELS = ("token", "sequence", "geometric")


def needs_proximal(correction: str) -> bool:
    """Whether `correction` takes PPO's ratio against pi_prox (one extra forward pass)."""
    return v.choice("needs_proximal", "correction", correction, CORRECTIONS) in (
        "tis", "icepop", "decoupled")


def _inputs(fn, prox_logp, behaviour_logp, mask):
    prox_logp = v.floating(fn, "prox_logp", prox_logp, rank=2, layout="[B, T]")
    behaviour_logp = v.floating(fn, "behaviour_logp", behaviour_logp, rank=2, layout="[B, T]")
    v.same_shape(fn, "behaviour_logp", behaviour_logp, "prox_logp", prox_logp.shape)
    mask = v.boolean(fn, "mask", mask, rank=2, layout="[B, T]")
    v.same_shape(fn, "mask", mask, "prox_logp", prox_logp.shape)
    return prox_logp, behaviour_logp, mask


def importance_log_weights(prox_logp, behaviour_logp, mask, *, level: str = "token"):
    """log rho of the behaviour-to-proximal importance weight, per token, stop-gradient.

    .. math::
        \\ell_t = \\mathrm{clamp}(\\log\\pi^{prox}_t - \\log\\pi^{behave}_t, \\pm 20), \\quad
        \\log\\rho_t = \\begin{cases} \\ell_t & \\text{token} \\\\
        \\sum_{s \\in m} \\ell_s & \\text{sequence} \\\\
        \\frac{1}{|m|}\\sum_{s \\in m} \\ell_s & \\text{geometric} \\end{cases}

    (per-sequence and geometric-mean weights: AReaL, arXiv 2505.24298; GSPO's
    length-normalised ratio, arXiv 2507.18071). The sequence sum is clamped to +-20 too,
    so `exp` stays finite.

    Returns:
        [B, T] float32, 0 where `mask` is 0 (a row without masked tokens: all 0).
    """
    fn = "importance_log_weights"
    prox_logp, behaviour_logp, mask = _inputs(fn, prox_logp, behaviour_logp, mask)
    level = v.choice(fn, "level", level, WEIGHT_LEVELS)
    log_w = jnp.where(mask, prox_logp - behaviour_logp, 0.0)
    log_w = jax.lax.stop_gradient(jnp.clip(log_w, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if level == "token":
        return log_w
    total = jnp.sum(log_w, axis=1, keepdims=True)
    if level == "geometric":
        total = total / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1).astype(jnp.float32)
    total = jnp.clip(total, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.where(mask, total, 0.0)


def off_policy_weights(prox_logp, behaviour_logp, mask, *, correction: str,
                       level: str = "token", cap=2.0, low=0.5, high=2.0):
    """The constant weights w of `correction` (table in the module docstring) and their
    diagnostics.

    .. math::
        w_t = \\min(\\rho_t, C) \\;(\\text{tis, decoupled}), \\qquad
        w_t = \\rho_t\\,[\\text{low} \\le \\rho_t \\le \\text{high}] \\;(\\text{icepop}),
        \\qquad w_t = 1 \\;(\\text{none, bypass})

    with rho from `importance_log_weights` (token level for tis and icepop, `level` for
    decoupled). The KL estimate is of KL(pi_behave || pi_prox) from the behaviour's own
    samples, per token: k1 = -log rho, k3 = (rho - 1) - log rho >= 0 (Schulman 2020,
    "Approximating KL divergence").

    Args:
        prox_logp: [B, T] log-probs under the parameters at the start of the update.
        behaviour_logp: [B, T] log-probs of the sampling policy.
        mask: [B, T] the tokens trained on.
        correction: one of `CORRECTIONS`.
        level: one of `WEIGHT_LEVELS` (decoupled only).
        cap: C >= 1 (tis, decoupled).
        low, high: icepop's bounds, 0 <= low <= 1 <= high.

    Returns:
        (w, metrics): w [B, T] float32, stop-gradient, 0 where `mask` is 0; metrics,
        float32 scalars over the masked tokens: `weight_mean`, `weight_max`,
        `truncated_fraction` (rho > C), `masked_fraction` (icepop's zeros),
        `kl_behaviour_k1`, `kl_behaviour_k3` (0 without masked tokens).
    """
    fn = "off_policy_weights"
    prox_logp, behaviour_logp, mask = _inputs(fn, prox_logp, behaviour_logp, mask)
    correction = v.choice(fn, "correction", correction, CORRECTIONS)
    level = v.choice(fn, "level", level, WEIGHT_LEVELS)
    cap = v.scalar(fn, "cap", cap, low=1.0)
    low = v.scalar(fn, "low", low, low=0.0, high=1.0)
    high = v.scalar(fn, "high", high, low=1.0)
    token_log_w = importance_log_weights(prox_logp, behaviour_logp, mask)
    log_rho = (importance_log_weights(prox_logp, behaviour_logp, mask, level=level)
               if correction == "decoupled" else token_log_w)
    rho = jnp.exp(log_rho)
    truncated = jnp.zeros_like(mask)
    masked = jnp.zeros_like(mask)
    if correction in ("none", "bypass"):
        w = jnp.ones_like(rho)
    elif correction == "icepop":
        masked = mask & ((rho < low) | (rho > high))
        w = jnp.where(masked, 0.0, rho)
    else:
        truncated = mask & (rho > cap)
        w = jnp.minimum(rho, cap)
    w = jax.lax.stop_gradient(jnp.where(mask, w, 0.0))
    count = jnp.sum(mask.astype(jnp.float32))
    per_token = lambda x: jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(count, 1.0)
    metrics = {
        "weight_mean": per_token(w),
        "weight_max": jnp.where(count > 0, jnp.max(jnp.where(mask, w, -jnp.inf)), 0.0),
        "truncated_fraction": per_token(truncated.astype(jnp.float32)),
        "masked_fraction": per_token(masked.astype(jnp.float32)),
        "kl_behaviour_k1": per_token(-token_log_w),
        "kl_behaviour_k3": per_token(jnp.expm1(token_log_w) - token_log_w),
    }
    return w, metrics


def weighted_advantages(advantages, weights):
    """A_t * w_t: the advantages that make a PPO-family loss (positively homogeneous in
    A) equal to w_t times itself. `advantages` [B] (sequence-level) or [B, T]."""
    advantages = v.floating("weighted_advantages", "advantages", advantages)
    weights = v.floating("weighted_advantages", "weights", weights, rank=2, layout="[B, T]")
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    return jax.lax.stop_gradient(advantages * weights)


def decoupled_policy_loss_per_token(logp, prox_logp, behaviour_logp, advantages, mask, *,
                                    correction: str = "decoupled", level: str = "token",
                                    cap=2.0, low=0.5, high=2.0, clip_low=0.2,
                                    clip_high=0.2, dual_clip=None) -> jax.Array:
    """Decoupled PPO per token (AReaL, arXiv 2505.24298; Hilton et al. 2022, arXiv
    2110.00641), with the weight of `correction` (`off_policy_weights`):

    .. math::
        L_t = w_t \\max(-A_t r_t, -A_t\\,\\mathrm{clip}(r_t, 1-\\epsilon_{low},
        1+\\epsilon_{high})), \\quad r_t = \\pi_\\theta / \\pi_{ref}

    pi_ref = pi_prox for tis / icepop / decoupled, pi_behave for none / bypass. With
    pi_prox == pi_behave, w = 1 and this is PPO exactly. w, the reference and the
    advantages are constants under the gradient.

    Returns:
        [B, T] float32, zero where `mask` is 0.
    """
    w, _ = off_policy_weights(prox_logp, behaviour_logp, mask, correction=correction,
                              level=level, cap=cap, low=low, high=high)
    reference = prox_logp if needs_proximal(correction) else behaviour_logp
    loss = policy_loss_per_token(logp, reference, advantages, mask, clip_low=clip_low,
                                 clip_high=clip_high, dual_clip=dual_clip)
    return loss * w

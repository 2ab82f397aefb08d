"""Off-policy corrections (arl.algorithms.off_policy) vs NumPy loops, and their properties:
decoupled PPO is PPO when pi_prox == pi_behave, the weight is a constant under the
gradient, weighting the advantages weights the loss."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import algorithms as alg
from arl.algorithms import off_policy as op


def weights_reference(prox, behave, mask, correction, level, cap, low, high):
    """(w, metrics) by plain loops in float64."""
    B, T = prox.shape
    token = np.zeros((B, T))
    for b, t in np.ndindex(B, T):
        if mask[b, t]:
            token[b, t] = min(max(prox[b, t] - behave[b, t], -20.0), 20.0)
    log_rho = token.copy()
    if correction == "decoupled" and level != "token":
        for b in range(B):
            n = int(mask[b].sum())
            total = token[b].sum() / (max(n, 1) if level == "geometric" else 1)
            total = min(max(total, -20.0), 20.0)
            log_rho[b] = np.where(mask[b], total, 0.0)
    w = np.zeros((B, T))
    truncated = masked = 0
    kl1, kl3 = [], []
    for b, t in np.ndindex(B, T):
        if not mask[b, t]:
            continue
        rho = math.exp(log_rho[b, t])
        if correction in ("none", "bypass"):
            w[b, t] = 1.0
        elif correction == "icepop":
            inside = low <= rho <= high
            masked += not inside
            w[b, t] = rho if inside else 0.0
        else:
            truncated += rho > cap
            w[b, t] = min(rho, cap)
        kl1.append(-token[b, t])
        kl3.append(math.exp(token[b, t]) - 1 - token[b, t])
    n = max(int(mask.sum()), 1)
    kept = w[mask.astype(bool)]
    metrics = dict(weight_mean=kept.sum() / n, weight_max=kept.max() if kept.size else 0.0,
                   truncated_fraction=truncated / n, masked_fraction=masked / n,
                   kl_behaviour_k1=sum(kl1) / n, kl_behaviour_k3=sum(kl3) / n)
    return w, metrics


def ppo_reference(logp, old, adv, mask, clip=0.2):
    loss = np.zeros(logp.shape)
    for b, t in np.ndindex(logp.shape):
        if mask[b, t]:
            r = math.exp(min(max(logp[b, t] - old[b, t], -20.0), 20.0))
            loss[b, t] = max(-adv[b, t] * r, -adv[b, t] * min(max(r, 1 - clip), 1 + clip))
    return loss


def sample(seed, B=4, T=12, spread=0.8):
    rng = np.random.default_rng(seed)
    behave = rng.normal(-1.5, 0.6, (B, T)).astype(np.float32)
    prox = (behave + rng.normal(0, spread, (B, T))).astype(np.float32)
    logp = (prox + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, (B, T)).astype(np.float32)
    mask = rng.random((B, T)) < 0.7
    mask[-1] = False  # a row without agent tokens
    return logp, prox, behave, adv, mask


@pytest.mark.parametrize("correction,level", [
    ("none", "token"), ("bypass", "token"), ("tis", "token"), ("icepop", "token"),
    ("decoupled", "token"), ("decoupled", "sequence"), ("decoupled", "geometric")])
def test_weights_match_numpy(correction, level):
    _, prox, behave, _, mask = sample(0)
    w, metrics = op.off_policy_weights(prox, behave, mask, correction=correction,
                                       level=level, cap=1.5, low=0.6, high=1.4)
    want_w, want = weights_reference(prox, behave, mask, correction, level, 1.5, 0.6, 1.4)
    assert w.dtype == jnp.float32
    np.testing.assert_allclose(w, want_w, rtol=2e-5, atol=1e-6)
    for name, value in want.items():
        np.testing.assert_allclose(metrics[name], value, rtol=2e-5, atol=1e-6, err_msg=name)
    if correction in ("tis", "decoupled") and level != "geometric":
        assert 0 < float(metrics["truncated_fraction"]) < 1  # the cap binds somewhere
    if correction == "icepop":
        assert 0 < float(metrics["masked_fraction"]) < 1


def test_hand_computed_weights():
    prox = np.log(np.array([[0.5, 0.2, 0.9]], np.float32))
    behave = np.log(np.array([[0.25, 0.4, 0.1]], np.float32))  # rho = 2, 0.5, 9
    mask = np.array([[1, 1, 1]])
    tis, m = op.off_policy_weights(prox, behave, mask, correction="tis", cap=3.0)
    np.testing.assert_allclose(tis, [[2.0, 0.5, 3.0]], rtol=1e-6)
    np.testing.assert_allclose(m["truncated_fraction"], 1 / 3, rtol=1e-6)
    ice, m = op.off_policy_weights(prox, behave, mask, correction="icepop", low=0.4, high=2.5)
    np.testing.assert_allclose(ice, [[2.0, 0.5, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(m["masked_fraction"], 1 / 3, rtol=1e-6)
    seq, _ = op.off_policy_weights(prox, behave, mask, correction="decoupled",
                                   level="sequence", cap=100.0)
    np.testing.assert_allclose(seq, [[9.0, 9.0, 9.0]], rtol=1e-5)  # 2 * 0.5 * 9
    geo, _ = op.off_policy_weights(prox, behave, mask, correction="decoupled",
                                   level="geometric", cap=3.0)
    np.testing.assert_allclose(geo, [[9.0 ** (1 / 3)] * 3], rtol=1e-5)


def test_decoupled_loss_matches_numpy():
    logp, prox, behave, adv, mask = sample(1)
    got = op.decoupled_policy_loss_per_token(logp, prox, behave, adv, mask, cap=1.5)
    w, _ = weights_reference(prox, behave, mask, "decoupled", "token", 1.5, 0.5, 2.0)
    np.testing.assert_allclose(got, w * ppo_reference(logp, prox, adv, mask), rtol=2e-5,
                               atol=1e-6)


@pytest.mark.parametrize("correction", ["tis", "icepop", "decoupled"])
def test_reduces_to_ppo_when_proximal_is_behaviour(correction):
    logp, _, behave, adv, mask = sample(2)
    got = op.decoupled_policy_loss_per_token(logp, behave, behave, adv, mask,
                                             correction=correction, level="sequence")
    want = alg.policy_loss_per_token(logp, behave, adv, mask)
    np.testing.assert_array_equal(got, want)  # w = exp(0) = 1 exactly


@pytest.mark.parametrize("correction", ["tis", "icepop", "decoupled"])
def test_weight_is_constant_under_the_gradient(correction):
    """d/d(logp) of w * PPO = w * d PPO / d(logp) against pi_prox; nothing flows into
    prox_logp or behaviour_logp."""
    logp, prox, behave, adv, mask = sample(3, spread=0.3)

    def total(lp, px, bh):
        return jnp.sum(op.decoupled_policy_loss_per_token(lp, px, bh, adv, mask,
                                                          correction=correction))

    d_logp, d_prox, d_behave = jax.grad(total, argnums=(0, 1, 2))(logp, prox, behave)
    w, _ = op.off_policy_weights(prox, behave, mask, correction=correction)
    want = w * jax.grad(lambda lp: jnp.sum(alg.policy_loss_per_token(lp, prox, adv, mask)))(
        logp)
    np.testing.assert_allclose(d_logp, want, rtol=1e-6, atol=1e-7)
    assert np.any(np.asarray(d_logp) != 0)
    np.testing.assert_array_equal(d_prox, 0.0)
    np.testing.assert_array_equal(d_behave, 0.0)


def test_no_nan_on_degenerate_input():
    B, T = 2, 4
    prox = np.full((B, T), -np.inf, np.float32)  # padding log-probs
    behave = np.full((B, T), -np.inf, np.float32)
    prox[0, 0], behave[0, 0] = 0.0, -200.0  # rho would overflow
    mask = np.zeros((B, T), bool)
    mask[0, 0] = True
    for correction in op.CORRECTIONS:
        for level in op.WEIGHT_LEVELS:
            w, metrics = op.off_policy_weights(prox, behave, mask, correction=correction,
                                               level=level)
            assert np.all(np.isfinite(w))
            assert all(np.isfinite(float(x)) for x in metrics.values())
    w, metrics = op.off_policy_weights(prox, behave, np.zeros((B, T)), correction="tis")
    np.testing.assert_array_equal(w, 0.0)
    assert all(float(x) == 0.0 for x in metrics.values())


def test_bad_arguments_name_the_argument():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="correction"):
        op.off_policy_weights(x, x, x, correction="vtrace")
    with pytest.raises(ValueError, match="level"):
        op.off_policy_weights(x, x, x, correction="decoupled", level="turn")
    with pytest.raises(ValueError, match="cap"):
        op.off_policy_weights(x, x, x, correction="tis", cap=0.5)
    with pytest.raises(ValueError, match="behaviour_logp"):
        op.off_policy_weights(x, np.zeros((2, 4), np.float32), x, correction="tis")


def test_jit_and_vmap():
    logp, prox, behave, adv, mask = sample(4)
    direct = op.decoupled_policy_loss_per_token(logp, prox, behave, adv, mask)
    jitted = jax.jit(lambda *a: op.decoupled_policy_loss_per_token(*a))(
        logp, prox, behave, adv, mask)
    mapped = jax.vmap(lambda *a: op.decoupled_policy_loss_per_token(
        *(x[None] for x in a))[0])(logp, prox, behave, adv, mask)
    np.testing.assert_allclose(jitted, direct, rtol=1e-6)
    np.testing.assert_allclose(mapped, direct, rtol=1e-6)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1),
                  correction=st.sampled_from(["tis", "icepop", "decoupled"]),
                  level=st.sampled_from(op.WEIGHT_LEVELS), cap=st.floats(1.0, 5.0))
def test_properties(seed, correction, level, cap):
    """w in [0, max(C, high)], zero off the mask; weighting the advantages weights the
    loss (homogeneity, the form the trainer uses)."""
    logp, prox, behave, adv, mask = sample(seed, spread=1.5)
    w, metrics = op.off_policy_weights(prox, behave, mask, correction=correction,
                                       level=level, cap=cap, high=2.0)
    w = np.asarray(w)
    assert np.all(w >= 0) and np.all(w <= max(cap, 2.0) * (1 + 1e-6))
    assert np.all(w[~mask] == 0)
    assert float(metrics["kl_behaviour_k3"]) >= 0
    via_advantages = alg.policy_loss_per_token(logp, prox, op.weighted_advantages(adv, w),
                                               mask)
    direct = op.decoupled_policy_loss_per_token(logp, prox, behave, adv, mask,
                                                correction=correction, level=level,
                                                cap=cap, high=2.0)
    np.testing.assert_allclose(via_advantages, direct, rtol=1e-5, atol=1e-6)

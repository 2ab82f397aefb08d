"""An independent oracle of the update's loss (`Learner.loss`): the whole loss of one
minibatch, every logged metric and the gradient, recomputed in plain NumPy float64 from
the formulas (PPO's clipped surrogate with both clips and the dual clip, the clipped value
loss, each KL estimator, the entropy bonus, ECHO and SFT, each aggregation mode) on
batches where every clip binds for some tokens and not for others.

The gradient is taken with respect to what the policy scores (log-probs, entropies,
values, demonstration log-probs): a policy whose scores are its parameters stands in for
the model, so the gradient of `Learner.loss` is the loss's own derivative, term by term.
A last test runs a real (tiny) transformer through the same oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl.trainers.policy import Policy, TokenScores
from arl.trainers.update import Learner, UpdateBatch
from tests import test_policy_score as policy_score_tests
from tests.models.helpers import SMALL, make

B, S, S_DEMO = 6, 10, 7
KL_KINDS = ("k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+")
AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                "seq-mean-token-sum-norm")


def loss_config(**overrides):
    """Narrow clips (both sides and the dual clip bind on the batches below), every term
    on."""
    settings = dict(clip_low=0.2, clip_high=0.28, dual_clip=1.6, value_coef=0.7,
                    value_clip=0.15, entropy_coef=0.03, kl_coef=0.2, echo_coef=0.1,
                    sft_coef=0.3)
    return policy_score_tests.loss_config(**{**settings, **overrides})


@dataclasses.dataclass(frozen=True)
class ScoresAreParameters:
    """A stand-in policy whose token scores are its parameters: {"logp", "entropy",
    "values"} [B, S] for the rollout's contexts and "demo_logp" [B, S_DEMO] for the
    demonstrations (told apart by their length). Unscored positions keep their
    (garbage) parameters, so the loss must mask them itself."""

    def merge(self, trainable, base=None):
        return trainable

    def score(self, params, tokens, *, entropy=True, **unused):
        if tokens.shape[1] == S_DEMO:
            return TokenScores(logp=params["demo_logp"], entropy=None)
        return TokenScores(logp=params["logp"], entropy=params["entropy"] if entropy else None,
                           values=params["values"])


def _batch(seed=0):
    """(scores as parameters, UpdateBatch) in float32, with log-ratios in +-0.9 (past both
    policy clips and the dual clip), value moves in +-0.4 (past the value clip),
    advantages of both signs, rows of 0 to S-1 agent tokens, observation tokens beside
    them, and garbage (large numbers) off the masks."""
    rng = np.random.default_rng(seed)
    agent = np.zeros((B, S), np.float32)
    for b, n in enumerate((7, 3, 0, 9, 5, 1)):
        agent[b, rng.choice(np.arange(1, S), n, replace=False)] = 1.0
    observation = ((rng.random((B, S)) < 0.4) & (agent == 0)).astype(np.float32)
    observation[:, 0] = 0.0
    garbage = 50.0 * (1.0 - agent)
    old_logp = -rng.uniform(0.2, 3.0, (B, S))
    logp = old_logp + rng.uniform(-0.9, 0.9, (B, S))
    params = {
        "logp": np.where(agent + observation > 0, logp, garbage),
        "entropy": np.where(agent > 0, rng.uniform(0.1, 2.0, (B, S)), garbage),
        "values": np.where(agent > 0, rng.normal(size=(B, S)), garbage),
        "demo_logp": -rng.uniform(0.1, 4.0, (B, S_DEMO)),
    }
    old_values = params["values"] + rng.uniform(-0.4, 0.4, (B, S))
    demo_mask = (rng.random((B, S_DEMO)) < 0.6).astype(np.float32)
    demo_mask[0] = 0.0  # a demonstration row without demonstrator tokens
    batch = UpdateBatch(
        tokens=jnp.zeros((B, S), jnp.int32), mask=jnp.asarray(agent),
        old_logp=jnp.asarray(old_logp * agent - garbage, jnp.float32),
        advantages=jnp.asarray(rng.normal(size=(B, S)) * agent + garbage, jnp.float32),
        observation_mask=jnp.asarray(observation),
        old_values=jnp.asarray(np.where(agent > 0, old_values, garbage), jnp.float32),
        returns=jnp.asarray(np.where(agent > 0, rng.normal(size=(B, S)), garbage), jnp.float32),
        ref_logp=jnp.asarray(old_logp + rng.uniform(-0.5, 0.5, (B, S)), jnp.float32),
        demo_tokens=jnp.zeros((B, S_DEMO), jnp.int32), demo_mask=jnp.asarray(demo_mask))
    return {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}, batch


# ----------------------------------------------------------------------------------------
# The NumPy float64 oracle.

def aggregation_weights(mask, mode, norm):
    """W with aggregate(L) = sum(W * L): every aggregation mode is linear in L."""
    mask = np.asarray(mask, np.float64)
    row_count = mask.sum(axis=1, keepdims=True)
    num_rows = max((row_count > 0).sum(), 1)
    if mode == "token-mean":
        return mask / max(mask.sum(), 1.0)
    if mode == "token-sum":
        return mask
    if mode == "seq-mean-token-sum":
        return mask / num_rows
    if mode == "seq-mean-token-mean":
        return mask / np.maximum(row_count, 1.0) / num_rows
    assert mode == "seq-mean-token-sum-norm"
    return mask / num_rows / norm


def kl_value_and_slope(kind, d):
    """(estimator of KL(pi || pi_ref), its derivative in log pi) per token, d = log pi -
    log pi_ref. A "+" kind has its base kind's value and k2's slope (straight-through)."""
    base = kind.rstrip("+")
    # k3 = e^x - x - 1 at x = -d, x clamped to +-20 and k3 to +-10 (flat where clamped).
    x = np.clip(-d, -20.0, 20.0)
    k3 = np.exp(x) - x - 1.0
    k3_slope = np.where((np.abs(d) < 20.0) & (np.abs(k3) < 10.0), 1.0 - np.exp(x), 0.0)
    value = {"k1": d, "abs": np.abs(d), "k2": 0.5 * d * d, "k3": np.clip(k3, -10.0, 10.0)}[base]
    slope = {"k1": np.ones_like(d), "abs": np.sign(d), "k2": d, "k3": k3_slope}[base]
    return value, (d if kind.endswith("+") else slope)


def oracle(params, batch: UpdateBatch, c, *, step, context_length=S):
    """(loss, metrics, gradient w.r.t. params) of one minibatch, in float64."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    m = f64(batch.mask)
    on = m > 0
    logp, ent, values = f64(params["logp"]), f64(params["entropy"]), f64(params["values"])
    norm = (c.norm or float(context_length)) if c.agg == "seq-mean-token-sum-norm" else None
    w = aggregation_weights(m, c.agg, norm)
    token_mean = aggregation_weights(m, "token-mean", None)
    grad = {k: np.zeros(np.shape(v)) for k, v in params.items()}
    metrics = {}

    # Policy: L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and min(L, -A c) for A < 0.
    adv = np.where(on, f64(batch.advantages), 0.0)
    log_ratio = np.where(on, logp - f64(batch.old_logp), 0.0)
    r = np.exp(log_ratio)
    unclipped = -adv * r
    clipped = -adv * np.clip(r, 1 - c.clip_low, 1 + c.clip_high)
    per_token = np.maximum(unclipped, clipped)
    # The surrogate follows r where the unclipped term is the larger (or r is inside).
    slope = np.where(unclipped >= clipped, -adv * r, 0.0)
    dual = np.zeros_like(on)
    if c.dual_clip:
        dual = (adv < 0) & (per_token > -adv * c.dual_clip) & on
        per_token = np.where(dual, -adv * c.dual_clip, per_token)
        slope = np.where(dual, 0.0, slope)
    policy = np.sum(w * per_token)
    grad["logp"] += w * slope
    count = max(m.sum(), 1.0)
    metrics.update({
        "policy/clip_fraction_low": np.sum(on & (adv < 0) & (r < 1 - c.clip_low)) / count,
        "policy/clip_fraction_high": np.sum(on & (adv > 0) & (r > 1 + c.clip_high)) / count,
        "policy/dual_clip_fraction": np.sum(dual) / count,
        "policy/approx_kl_k1": np.sum(np.where(on, -log_ratio, 0.0)) / count,
        "policy/approx_kl_k3": np.sum(np.where(on, r - 1 - log_ratio, 0.0)) / count,
        "policy/ratio_mean": np.sum(np.where(on, r, 0.0)) / count,
        "policy/ratio_min": r[on].min(), "policy/ratio_max": r[on].max(),
        "loss/policy": policy,
        "entropy": np.sum(token_mean * ent),
    })
    total = policy

    # Entropy bonus: - coef * agg(H).
    total -= c.entropy_coef * np.sum(w * ent)
    grad["entropy"] -= c.entropy_coef * w

    # Value: 0.5 max((v - R)^2, (v_old + clip(v - v_old, +-eps) - R)^2).
    returns, old_values = f64(batch.returns), f64(batch.old_values)
    v_clipped = old_values + np.clip(values - old_values, -c.value_clip, c.value_clip)
    square, square_clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    value_per_token = 0.5 * np.maximum(square, square_clipped)
    value_clip_binds = on & (np.abs(values - old_values) > c.value_clip) & (
        square_clipped > square)
    value_slope = np.where(value_clip_binds, 0.0, values - returns)
    value = np.sum(w * value_per_token)
    total += c.value_coef * value
    grad["values"] += c.value_coef * w * value_slope
    residual = returns - values
    metrics.update({
        "loss/value": value,
        "value/clip_fraction": np.sum(value_clip_binds) / count,
        "value/explained_variance": 1.0 - np.var(residual[on], ddof=1)
        / np.var(returns[on], ddof=1),
    })

    # KL to the reference.
    kl, kl_slope = kl_value_and_slope(c.kl_kind, np.where(on, logp - f64(batch.ref_logp), 0.0))
    metrics["kl_ref"] = np.sum(token_mean * kl)
    if not c.kl_in_reward:
        total += c.kl_coef * np.sum(w * kl)
        grad["logp"] += c.kl_coef * w * kl_slope

    # ECHO: token-mean cross-entropy on the observation tokens.
    obs = f64(batch.observation_mask)
    echo_w = obs / max(obs.sum(), 1.0)
    metrics["loss/echo"] = -np.sum(echo_w * np.where(obs > 0, logp, 0.0))
    total += c.echo_coef * metrics["loss/echo"]
    grad["logp"] -= c.echo_coef * echo_w

    # SFT on demonstrations, alpha(step) held then decayed linearly.
    demo = f64(batch.demo_mask)
    demo_w = demo / max(demo.sum(), 1.0)
    metrics["loss/sft"] = -np.sum(demo_w * f64(params["demo_logp"]))
    alpha = c.sft_coef
    if c.sft_coef_final >= 0:
        frac = np.clip((step - c.sft_hold_steps) / max(1, c.sft_decay_steps), 0.0, 1.0)
        alpha = c.sft_coef + frac * (c.sft_coef_final - c.sft_coef)
    total += alpha * metrics["loss/sft"]
    grad["demo_logp"] -= alpha * demo_w
    metrics["loss/total"] = total
    return total, metrics, grad


# ----------------------------------------------------------------------------------------

def _learner(c, policy=ScoresAreParameters(), context_length=S):
    return Learner(policy, optax.sgd(0.1), c, epochs=1, minibatches=1, mesh=None,
                   context_length=context_length)


def _check(c, params, batch, step=0):
    """Learner.loss's loss, metrics and gradient against the oracle at 1e-5."""
    (loss, metrics), grad = jax.jit(jax.value_and_grad(_learner(c).loss, has_aux=True))(
        params, batch, step)
    want_loss, want_metrics, want_grad = oracle(params, batch, c, step=step)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(want_metrics)
    for key, want in want_metrics.items():
        np.testing.assert_allclose(metrics[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    for key, want in want_grad.items():
        np.testing.assert_allclose(grad[key], want, rtol=1e-5, atol=1e-7, err_msg=key)
    return want_metrics


def test_every_clip_binds_on_the_oracle_batch():
    """The batch is meaningful: each clip binds for some tokens and not for others."""
    for seed in (0, 4):
        params, batch = _batch(seed)
        _, metrics, _ = oracle(params, batch, loss_config(), step=0)
        for key in ("policy/clip_fraction_low", "policy/clip_fraction_high",
                    "policy/dual_clip_fraction", "value/clip_fraction"):
            assert 0.05 < metrics[key] < 0.6, (seed, key, metrics[key])


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_loss_metrics_and_gradient_equal_the_oracle_in_each_aggregation(agg):
    params, batch = _batch()
    _check(loss_config(agg=agg, norm=7.0 if agg.endswith("norm") else 0.0), params, batch)


def test_each_kl_estimator_equals_the_oracle():
    """One minibatch, every KL estimator (the other terms as above)."""
    params, batch = _batch(seed=4)
    for kind in KL_KINDS:
        _check(loss_config(kl_kind=kind, agg="seq-mean-token-mean"), params, batch)


def test_terms_turned_off_and_kl_in_reward_equal_the_oracle():
    """No dual clip, no value clip (a large one), KL in the reward (logged, not in the
    loss), a decaying SFT weight half-way; the default context-length norm."""
    params, batch = _batch(seed=2)
    c = loss_config(dual_clip=0.0, value_clip=1e6, kl_in_reward=True, sft_coef_final=0.1,
                    sft_hold_steps=2, sft_decay_steps=4, agg="seq-mean-token-sum-norm")
    metrics = _check(c, params, batch, step=4)
    assert metrics["policy/dual_clip_fraction"] == 0 and metrics["value/clip_fraction"] == 0


def test_a_real_policy_through_the_oracle():
    """A tiny transformer scores the batch: Learner.loss equals the oracle on the model's
    own log-probs, entropies and values, and the parameters' gradient is the oracle's
    gradient pulled back through the scores."""
    model, _, model_params = make(dataclasses.replace(SMALL, max_len=S))
    policy = Policy(model=model, temperature=0.8)
    _, batch = _batch(seed=3)
    tokens = jax.random.randint(jax.random.key(0), (B, S), 0, SMALL.vocab_size)
    demo_tokens = jax.random.randint(jax.random.key(1), (B, S), 0, SMALL.vocab_size)
    demo_mask = jnp.asarray(np.random.default_rng(4).random((B, S)) < 0.5, jnp.float32)
    demo_mask = demo_mask.at[:, 0].set(0.0)

    def scores(p):
        main = policy.score(p, tokens)
        return {"logp": main.logp, "entropy": main.entropy, "values": main.values,
                "demo_logp": policy.score(p, demo_tokens, entropy=False).logp}

    at_params, pull_back = jax.vjp(scores, model_params)
    # The batch's old log-probs and values sit around the model's, so that the clips bind.
    rng = np.random.default_rng(5)
    batch = batch.replace(
        tokens=tokens, demo_tokens=demo_tokens, demo_mask=demo_mask,
        old_logp=at_params["logp"] + jnp.asarray(rng.uniform(-0.9, 0.9, (B, S)), jnp.float32),
        ref_logp=at_params["logp"] + jnp.asarray(rng.uniform(-3.0, 3.0, (B, S)), jnp.float32),
        old_values=at_params["values"] + jnp.asarray(rng.uniform(-0.4, 0.4, (B, S)),
                                                     jnp.float32))
    c = loss_config(agg="seq-mean-token-sum")
    (loss, metrics), grad = jax.jit(jax.value_and_grad(
        _learner(c, policy).loss, has_aux=True))(model_params, batch, 0)
    want_loss, want_metrics, want_grad = oracle(at_params, batch, c, step=0)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert set(metrics) == set(want_metrics)
    for key, want in want_metrics.items():
        np.testing.assert_allclose(metrics[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    assert want_metrics["policy/clip_fraction_low"] > 0 and want_metrics[
        "policy/clip_fraction_high"] > 0 and want_metrics["value/clip_fraction"] > 0
    (pulled,) = pull_back({k: jnp.asarray(v, jnp.float32) for k, v in want_grad.items()})
    for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(pulled)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)

"""GSPO's sequence-ratio loss and CISPO's clipped-weight loss vs NumPy loops, hand cases,
gradients, jit/vmap and degenerate input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import algorithms as alg


def _mean_over_rows(per_token, mask, agg):
    """The two aggregations the references use, in float64."""
    if agg == "token-mean":
        return per_token[mask].sum() / max(mask.sum(), 1)
    rows = [per_token[b][mask[b]].mean() for b in range(mask.shape[0]) if mask[b].any()]
    return sum(rows) / len(rows) if rows else 0.0


def gspo_reference(logp, old, adv, mask, clip_low, clip_high, agg):
    """(loss, d loss / d logp) of GSPO, row by row in float64 (the paper's gradient:
    d s_i = s_i * mean_t d log pi_t)."""
    logp, old = logp.astype(np.float64), old.astype(np.float64)
    per_token = np.zeros(logp.shape)
    weight = np.zeros(logp.shape)  # d per_token[b, t] / d logp[b, t]
    for b in range(logp.shape[0]):
        agent = mask[b]
        n = agent.sum()
        s = math.exp(min(max((logp[b] - old[b])[agent].sum() / max(n, 1), -20), 20))
        a = adv[b]
        unclipped, clipped = -a * s, -a * min(max(s, 1 - clip_low), 1 + clip_high)
        per_token[b, agent] = max(unclipped, clipped)
        inside = 1 - clip_low <= s <= 1 + clip_high
        weight[b, agent] = -a * s if (unclipped >= clipped or inside) else 0.0
    loss = _mean_over_rows(per_token, mask, agg)
    grad = np.zeros(logp.shape)
    for b, t in zip(*np.nonzero(mask)):
        if agg == "token-mean":
            grad[b, t] = weight[b, t] / mask.sum()
        else:
            rows = sum(mask[i].any() for i in range(mask.shape[0]))
            grad[b, t] = weight[b, t] / mask[b].sum() / rows
    return loss, grad


def cispo_reference(logp, old, adv, mask, clip_low, clip_high, agg):
    """(loss, d loss / d logp) of CISPO per token in float64."""
    logp, old = logp.astype(np.float64), old.astype(np.float64)
    per_token = np.zeros(logp.shape)
    weight = np.zeros(logp.shape)
    for b, t in zip(*np.nonzero(mask)):
        r = math.exp(min(max(logp[b, t] - old[b, t], -20), 20))
        w = min(max(r, 1 - clip_low), 1 + clip_high)
        per_token[b, t] = -w * adv[b] * logp[b, t]
        weight[b, t] = -w * adv[b]
    loss = _mean_over_rows(per_token, mask, agg)
    grad = np.zeros(logp.shape)
    for b, t in zip(*np.nonzero(mask)):
        grad[b, t] = weight[b, t] / (mask.sum() if agg == "token-mean"
                                     else mask[b].sum() * sum(m.any() for m in mask))
    return loss, grad


def _batch(seed, shape=(6, 7), scale=0.3):
    rng = np.random.default_rng(seed)
    old = (rng.normal(size=shape) - 2).astype(np.float32)
    logp = (old + scale * rng.normal(size=shape)).astype(np.float32)
    adv = rng.normal(size=shape[0]).astype(np.float32)
    mask = rng.random(shape) < 0.7
    mask[0] = False  # a row without agent tokens
    mask[1, :] = True
    return logp, old, adv, mask


KERNELS = {"gspo": (alg.gspo_policy_loss, gspo_reference),
           "cispo": (alg.cispo_policy_loss, cispo_reference)}


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed,clip", [(0, (0.05, 0.05)), (1, (0.2, 0.28)), (2, (1.0, 0.1))])
def test_loss_and_gradient_match_numpy(name, agg, seed, clip):
    kernel, reference = KERNELS[name]
    logp, old, adv, mask = _batch(seed)
    want_loss, want_grad = reference(logp, old, adv, mask, *clip, agg)

    def loss_fn(lp):
        return kernel(lp, old, adv, mask, clip_low=clip[0], clip_high=clip[1], agg=agg)[0]

    loss, grad = jax.jit(jax.value_and_grad(loss_fn))(jnp.asarray(logp))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)


def test_gspo_hand_case():
    # Row 0: token log-ratios (log 1.25, 0): s = sqrt(1.25) = 1.118 > 1 + eps, A = 1 >
    # 0: clipped, loss -(1 + 4e-4), no gradient. Row 1: (0, log 2, 0): s = 2^(1/3), A =
    # -1: the unclipped 2^(1/3) is the larger; gradient 2^(1/3) / 3 per token / 2 rows.
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.1], [0.2, 0.2, 0.9]]))
    old = jnp.log(jnp.array([[0.4, 0.25, 0.2], [0.2, 0.1, 0.9]]))
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
    adv = jnp.array([1.0, -1.0])
    s1 = 2 ** (1 / 3)
    (loss, metrics), grad = jax.value_and_grad(alg.gspo_policy_loss, has_aux=True)(
        logp, old, adv, mask)
    np.testing.assert_allclose(loss, (-(1 + 4e-4) + s1) / 2, rtol=1e-6)
    np.testing.assert_allclose(grad, [[0, 0, 0], [s1 / 6] * 3], rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_fraction_high"], 2 / 5)
    np.testing.assert_allclose(metrics["clip_fraction_low"], 0.0)
    np.testing.assert_allclose(metrics["ratio_max"], s1, rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_min"], 1.25 ** 0.5, rtol=1e-6)


def test_cispo_hand_case_keeps_the_gradient_of_clipped_tokens():
    # Ratios (1.25, 1 | 1, 2, 1); the weight of the ratio-2 token is clipped to 1.28 but
    # the token keeps its gradient -w A / 5 (PPO would give it none).
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.1], [0.2, 0.2, 0.9]]))
    old = jnp.log(jnp.array([[0.4, 0.25, 0.2], [0.2, 0.1, 0.9]]))
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
    adv = jnp.array([1.0, -1.0])
    (loss, metrics), grad = jax.value_and_grad(alg.cispo_policy_loss, has_aux=True)(
        logp, old, adv, mask)
    want = -(1.25 * np.log(0.5) + np.log(0.25)) + (np.log(0.2) + 1.28 * np.log(0.2)
                                                    + np.log(0.9))
    np.testing.assert_allclose(loss, want / 5, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.25, -0.2, 0], [0.2, 0.256, 0.2]], rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_fraction_high"], 1 / 5)
    # At eps_high = 0.2 the ratio-1.25 token (A > 0) is clipped: PPO drops its gradient,
    # CISPO keeps it at weight 1.2.
    ppo_grad = jax.grad(lambda lp: alg.policy_loss(lp, old, adv, mask, clip_high=0.2)[0])(
        logp)
    cispo_grad = jax.grad(lambda lp: alg.cispo_policy_loss(lp, old, adv, mask,
                                                           clip_high=0.2)[0])(logp)
    assert float(ppo_grad[0, 0]) == 0.0
    np.testing.assert_allclose(cispo_grad[0, 0], -1.2 / 5, rtol=1e-6)


def test_gspo_with_sequence_advantages_is_the_papers_sequence_objective():
    """With [B] advantages and seq-mean-token-mean, loss = -(1/G) sum_i min(s_i A_i,
    clip(s_i) A_i), and its gradient that of the same expression of s_i(theta)."""
    logp, old, adv, mask = _batch(3, scale=0.01)
    mask[0, :3] = True

    def paper(lp):
        n = jnp.sum(mask, axis=1)
        s = jnp.exp(jnp.sum(jnp.where(mask, lp - old, 0.0), axis=1) / n)
        return -jnp.mean(jnp.minimum(s * adv, jnp.clip(s, 1 - 3e-4, 1 + 4e-4) * adv))

    ours = lambda lp: alg.gspo_policy_loss(lp, old, adv, mask)[0]  # noqa: E731
    np.testing.assert_allclose(ours(logp), paper(logp), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(logp), jax.grad(paper)(logp), rtol=1e-4,
                               atol=1e-8)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_vmap_equals_a_loop_and_per_token_matches(name):
    kernel, _ = KERNELS[name]
    per_token = {"gspo": alg.gspo_policy_loss_per_token,
                 "cispo": alg.cispo_policy_loss_per_token}[name]
    batches = [_batch(seed) for seed in range(3)]
    stacked = [np.stack(x) for x in zip(*batches)]
    vmapped = jax.vmap(lambda *a: kernel(*a)[0])(*stacked)
    looped = [kernel(*b)[0] for b in batches]
    np.testing.assert_allclose(vmapped, looped, rtol=1e-6)
    logp, old, adv, mask = batches[0]
    tokens = per_token(logp, old, adv, mask)
    assert tokens.shape == logp.shape and tokens.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(tokens)[~mask], 0.0)
    np.testing.assert_allclose(alg.aggregate(tokens, mask, "token-mean"),
                               kernel(logp, old, adv, mask, agg="token-mean")[0], rtol=1e-6)


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("garbage", [-np.inf, np.nan, 1e30])
def test_masked_garbage_and_huge_ratios_give_finite_values_and_zero_gradient(name,
                                                                            garbage):
    kernel, _ = KERNELS[name]
    logp, old, adv, mask = _batch(4, scale=40.0)  # log-ratios far beyond the clamp
    logp = np.where(mask, logp, garbage).astype(np.float32)
    old = np.where(mask, old, garbage).astype(np.float32)
    (loss, metrics), grad = jax.value_and_grad(kernel, has_aux=True)(
        jnp.asarray(logp), old, adv, mask)
    assert np.isfinite(loss) and all(np.isfinite(v) for v in metrics.values())
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)
    empty = np.zeros_like(mask)
    loss, metrics = kernel(logp, old, adv, empty)
    assert float(loss) == 0.0 and float(metrics["ratio_max"]) == 0.0


@pytest.mark.parametrize("kernel", [alg.gspo_policy_loss, alg.cispo_policy_loss])
def test_bad_arguments_fail_in_python_with_the_argument_named(kernel):
    logp, old, adv, mask = _batch(0)
    with pytest.raises(ValueError, match="`clip_low` must be <= 1.0"):
        kernel(logp, old, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match="`old_logp` must have the shape of `logp`"):
        kernel(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        kernel(logp, old, adv, mask, agg="mean")

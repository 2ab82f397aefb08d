"""GAE, discounted returns, turn-level GAE and whitening against plain-NumPy loops."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from arl import algorithms as alg

METHODS = ("scan", "associative")


# ---------------------------------------------------------------- NumPy references


def gae_reference(rewards, values, mask, gamma, lam, bootstrap_value=None, dones=None,
                  truncated=None, next_values=None):
    """docs/kernels.md, literally: one Python loop per row, backwards in time."""
    batch, length = rewards.shape
    advantages = np.zeros((batch, length))
    for b in range(batch):
        next_value = 0.0 if bootstrap_value is None else float(bootstrap_value[b])
        next_advantage = 0.0
        for t in reversed(range(length)):
            is_truncated = truncated is not None and truncated[b, t]
            if (dones is not None and dones[b, t]) or is_truncated:
                next_value = float(next_values[b, t]) if is_truncated else 0.0
                next_advantage = 0.0
            if mask[b, t]:
                delta = rewards[b, t] + gamma * next_value - values[b, t]
                advantage = delta + gamma * lam * next_advantage
                advantages[b, t] = advantage
                next_value, next_advantage = values[b, t], advantage
    returns = np.where(mask, advantages + values, 0.0)
    return advantages, returns


def discounted_returns_reference(rewards, mask, gamma, bootstrap_value=None):
    batch, length = rewards.shape
    out = np.zeros((batch, length))
    for b in range(batch):
        running = 0.0 if bootstrap_value is None else float(bootstrap_value[b])
        for t in reversed(range(length)):
            if mask[b, t]:
                running = rewards[b, t] + gamma * running
                out[b, t] = running
    return out


def turn_level_gae_reference(rewards, values, mask, turn_end, gamma, lam, turn_gamma,
                             turn_lam):
    """Bi-level GAE as in RAGEN: turn level over turn ends, then token level per turn."""
    batch, length = rewards.shape
    advantages = np.zeros((batch, length))
    for b in range(batch):
        ends = [t for t in range(length) if turn_end[b, t] and mask[b, t]]
        token_rewards = np.where(mask[b], rewards[b], 0.0).astype(np.float64)
        last = 0.0
        turn_returns = {}
        for k in reversed(range(len(ends))):
            next_value = values[b, ends[k + 1]] if k + 1 < len(ends) else 0.0
            delta = rewards[b, ends[k]] + turn_gamma * next_value - values[b, ends[k]]
            last = delta + turn_gamma * turn_lam * last
            turn_returns[ends[k]] = last + values[b, ends[k]]
        for pos, ret in turn_returns.items():
            token_rewards[pos] = ret
        agent = [t for t in range(length) if mask[b, t]]
        last, next_value = 0.0, 0.0
        for i in reversed(range(len(agent))):
            t = agent[i]
            if t in turn_returns:
                next_value, last = 0.0, 0.0
            delta = token_rewards[t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam * last
            advantages[b, t] = last
            next_value = values[b, t]
    return advantages, np.where(mask, advantages + values, 0.0)


def whiten_reference(x, mask, shift_mean=True):
    selected = [float(xi) for xi, mi in zip(x.ravel(), mask.ravel()) if mi]
    n = len(selected)
    if n == 0:
        return np.zeros_like(x, dtype=np.float64)
    mean = sum(selected) / n
    var = sum((s - mean) ** 2 for s in selected) / max(n - 1, 1)
    out = (x - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return np.where(mask, out, 0.0)


def random_batch(seed, batch=4, length=13, agent_fraction=0.6):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(batch, length)).astype(np.float32)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    mask = rng.random((batch, length)) < agent_fraction
    return rng, rewards, values, mask


# ---------------------------------------------------------------- GAE


class GaeTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*METHODS)
    def test_hand_computed_multi_turn(self, method):
        # agent, observation, agent: the observation is skipped, gamma counts agent tokens.
        rewards = np.array([[0.0, 0.0, 1.0]], np.float32)
        values = np.array([[0.2, 9.0, 0.6]], np.float32)
        mask = np.array([[1, 0, 1]], bool)
        fn = self.variant(functools.partial(alg.gae, gamma=0.9, lam=0.8, method=method))
        advantages, returns = fn(rewards, values, mask)
        np.testing.assert_allclose(advantages, [[0.628, 0.0, 0.4]], rtol=1e-6)
        np.testing.assert_allclose(returns, [[0.828, 0.0, 1.0]], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*METHODS)
    def test_hand_computed_boundaries(self, method):
        rewards = np.array([[1.0, 0.0, 2.0]], np.float32)
        values = np.array([[0.5, 0.1, 0.3]], np.float32)
        mask = np.ones((1, 3), bool)
        done_first = np.array([[1, 0, 0]], bool)
        fn = self.variant(functools.partial(alg.gae, method=method))
        advantages, _ = fn(rewards, values, mask, dones=done_first)
        np.testing.assert_allclose(advantages, [[0.5, 1.9, 1.7]], rtol=1e-6)
        advantages, _ = fn(rewards, values, mask, truncated=done_first,
                           next_values=np.full((1, 3), 0.4, np.float32))
        np.testing.assert_allclose(advantages, [[0.9, 1.9, 1.7]], rtol=1e-6)
        advantages, _ = fn(rewards, values, mask, bootstrap_value=np.array([2.0], np.float32))
        np.testing.assert_allclose(advantages, [[4.5, 3.9, 3.7]],
                                   rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*METHODS)
    def test_matches_numpy_reference(self, method):
        rng, rewards, values, mask = random_batch(0, batch=5, length=17)
        bootstrap = rng.normal(size=5).astype(np.float32)
        dones = rng.random((5, 17)) < 0.12
        truncated = rng.random((5, 17)) < 0.08
        next_values = rng.normal(size=(5, 17)).astype(np.float32)
        fn = self.variant(functools.partial(alg.gae, gamma=0.95, lam=0.9, method=method))
        got = fn(rewards, values, mask, bootstrap_value=bootstrap, dones=dones,
                 truncated=truncated, next_values=next_values)
        want = gae_reference(rewards, values, mask, 0.95, 0.9, bootstrap, dones, truncated,
                             next_values)
        for g, w in zip(got, want):
            chex.assert_shape(g, (5, 17))
            chex.assert_type(g, jnp.float32)
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

    def test_unmasked_equals_rlax(self):
        rlax = pytest.importorskip("rlax")
        _, rewards, values, _ = random_batch(1, batch=3, length=11)
        bootstrap = np.array([0.3, -1.0, 2.0], np.float32)
        want = jax.jit(jax.vmap(rlax.truncated_generalized_advantage_estimation,
                                in_axes=(0, 0, None, 0)))(
            rewards, np.full_like(rewards, 0.97), 0.9,
            np.concatenate([values, bootstrap[:, None]], axis=1))
        for method in METHODS:
            got, _ = alg.gae(rewards, values, np.ones_like(rewards, bool), gamma=0.97,
                             lam=0.9, bootstrap_value=bootstrap, method=method)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_vmap_over_leading_axis(self):
        _, rewards, values, mask = random_batch(2, batch=6, length=9)
        stack = lambda x: x.reshape(3, 2, 9)
        fn = functools.partial(alg.gae, gamma=0.9, lam=0.7)
        got = jax.vmap(fn)(stack(rewards), stack(values), stack(mask))
        want = fn(rewards, values, mask)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.reshape(6, 9), w, rtol=1e-6, atol=1e-6)

    def test_vmap_over_hyperparameters(self):
        _, rewards, values, mask = random_batch(3)
        gammas = jnp.array([0.5, 0.9, 1.0])
        got, _ = jax.vmap(lambda g: alg.gae(rewards, values, mask, gamma=g, lam=0.8))(gammas)
        for i, g in enumerate([0.5, 0.9, 1.0]):
            want, _ = gae_reference(rewards, values, mask, g, 0.8)
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)

    def test_degenerate_inputs_are_finite_and_zero_where_masked(self):
        rewards = np.full((2, 5), np.nan, np.float32)  # garbage outside the mask
        values = np.full((2, 5), np.inf, np.float32)
        mask = np.zeros((2, 5), bool)
        mask[1, 2] = True
        rewards[1, 2], values[1, 2] = 1.0, 0.25
        for method in METHODS:
            advantages, returns = alg.gae(rewards, values, mask, gamma=0.9, method=method)
            np.testing.assert_array_equal(np.isfinite(advantages), True)
            np.testing.assert_allclose(advantages[1, 2], 0.75)
            assert float(jnp.sum(jnp.abs(advantages))) == pytest.approx(0.75)
            np.testing.assert_allclose(returns[1, 2], 1.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(values=np.zeros((2, 4), np.float32)), r"`values` must have the shape"),
    (dict(mask=np.ones((3,), bool)), r"`mask` must have rank 2"),
    (dict(rewards=np.zeros((2, 3), np.int32)), r"`rewards` must have a floating dtype"),
    (dict(bootstrap_value=np.zeros((3,), np.float32)), r"`bootstrap_value`.*\[B\]"),
    (dict(gamma=1.5), r"`gamma` must be <= 1"),
    (dict(truncated=np.zeros((2, 3), bool)), r"`truncated` needs `next_values`"),
    (dict(method="fast"), r"allowed values: 'auto', 'scan', 'associative'"),
])
def test_gae_bad_input_raises(kwargs, match):
    args = dict(rewards=np.zeros((2, 3), np.float32), values=np.zeros((2, 3), np.float32),
                mask=np.ones((2, 3), bool))
    args.update(kwargs)
    rewards, values, mask = args.pop("rewards"), args.pop("values"), args.pop("mask")
    with pytest.raises((ValueError, TypeError), match=match):
        alg.gae(rewards, values, mask, **args)


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), agent_fraction=st.floats(0.0, 1.0))
def test_gae_gamma_lambda_one_is_reward_to_go_minus_value(seed, agent_fraction):
    _, rewards, values, mask = random_batch(seed, batch=3, length=8,
                                            agent_fraction=agent_fraction)
    agent_rewards = np.where(mask, rewards, 0.0)
    reward_to_go = np.cumsum(agent_rewards[:, ::-1], axis=1)[:, ::-1]
    for method in METHODS:
        advantages, returns = _jit_gae_one(rewards, values, mask, method)
        np.testing.assert_allclose(advantages, np.where(mask, reward_to_go - values, 0.0),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(returns, np.where(mask, reward_to_go, 0.0), rtol=1e-4,
                                   atol=1e-4)


@functools.partial(jax.jit, static_argnums=3)
def _jit_gae_one(rewards, values, mask, method):
    return alg.gae(rewards, values, mask, gamma=1.0, lam=1.0, method=method)


# ---------------------------------------------------------------- returns, turn level


class ReturnsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_discounted_returns_matches_reference(self):
        rng, rewards, _, mask = random_batch(4, batch=3, length=10)
        bootstrap = rng.normal(size=3).astype(np.float32)
        fn = self.variant(functools.partial(alg.discounted_returns, gamma=0.8))
        got = fn(rewards, mask, bootstrap_value=bootstrap)
        np.testing.assert_allclose(
            got, discounted_returns_reference(rewards, mask, 0.8, bootstrap), rtol=1e-5,
            atol=1e-5)

    def test_discounted_returns_hand_computed(self):
        got = alg.discounted_returns(np.array([[1.0, 5.0, 2.0]], np.float32),
                                     np.array([[1, 0, 1]]), gamma=0.5)
        np.testing.assert_allclose(got, [[2.0, 0.0, 2.0]])

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*METHODS)
    def test_turn_level_gae_matches_reference(self, method):
        rng, rewards, values, mask = random_batch(5, batch=4, length=16, agent_fraction=0.7)
        turn_end = rng.random((4, 16)) < 0.25
        fn = self.variant(functools.partial(alg.turn_level_gae, gamma=0.97, lam=0.9,
                                            turn_gamma=0.8, turn_lam=0.7, method=method))
        got = fn(rewards, values, mask, turn_end)
        want = turn_level_gae_reference(rewards, values, mask, turn_end, 0.97, 0.9, 0.8, 0.7)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

    def test_turn_level_gae_hand_computed(self):
        # Two turns of two agent tokens with one observation token between them.
        rewards = np.array([[0.0, 1.0, 0.0, 0.0, 2.0]], np.float32)
        values = np.array([[0.1, 0.2, 7.0, 0.3, 0.4]], np.float32)
        mask = np.array([[1, 1, 0, 1, 1]], bool)
        turn_end = np.array([[0, 1, 0, 0, 1]], bool)
        advantages, _ = alg.turn_level_gae(rewards, values, mask, turn_end, gamma=1.0,
                                           lam=1.0, turn_gamma=0.5, turn_lam=1.0)
        # Turn 2: A = 2 - 0.4 = 1.6, G = 2.0. Turn 1: A = 1 + 0.5*0.4 - 0.2 + 0.5*1.6 = 1.8,
        # G = 2.0. Inside turn 1: token 0 gets G_1 - V_0 = 1.9; inside turn 2 token 3
        # gets G_2 - V_3 = 1.7.
        np.testing.assert_allclose(advantages, [[1.9, 1.8, 0.0, 1.7, 1.6]], rtol=1e-6)


# ---------------------------------------------------------------- whiten


class WhitenTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(True, False)
    def test_matches_reference(self, shift_mean):
        rng = np.random.default_rng(6)
        x = (3.0 + 2.0 * rng.normal(size=(4, 7))).astype(np.float32)
        mask = rng.random((4, 7)) < 0.5
        fn = self.variant(functools.partial(alg.whiten, shift_mean=shift_mean))
        np.testing.assert_allclose(fn(x, mask), whiten_reference(x, mask, shift_mean),
                                   rtol=1e-5, atol=1e-5)

    def test_hand_computed_and_degenerate(self):
        got = alg.whiten(np.array([1.0, 2.0, 3.0, 100.0], np.float32),
                         np.array([1, 1, 1, 0]))
        np.testing.assert_allclose(got, [-1.0, 0.0, 1.0, 0.0], atol=1e-6)
        np.testing.assert_array_equal(alg.whiten(np.ones(3, np.float32), np.zeros(3)), 0.0)
        np.testing.assert_array_equal(alg.whiten(np.ones(3, np.float32), [0, 1, 0]), 0.0)
        np.testing.assert_array_equal(alg.whiten(np.full(3, 5.0, np.float32), [1, 1, 1]),
                                      0.0)

    def test_bfloat16_input_gives_float32(self):
        out = alg.whiten(jnp.arange(4, dtype=jnp.bfloat16), jnp.ones(4, bool))
        chex.assert_type(out, jnp.float32)

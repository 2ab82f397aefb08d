"""MLP actor-critics: shapes, dtypes, PureJaxRL orthogonal initialisation, jit/vmap."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl.models import ActorCritic, GaussianActorCritic


@functools.lru_cache(maxsize=None)
def _actor_critic_params():
    """ActorCritic(3) on 4-dim observations, initialised once (QR compilation is slow)."""
    return jax.jit(ActorCritic(num_actions=3).init)(jax.random.key(0), jnp.ones((1, 4)))


def _gram(kernel):
    kernel = np.asarray(kernel, np.float64)
    return kernel.T @ kernel if kernel.shape[0] >= kernel.shape[1] else kernel @ kernel.T


def test_actor_critic_shapes_and_orthogonal_init():
    model = ActorCritic(num_actions=3)
    obs = jnp.ones((5, 4))
    params = _actor_critic_params()["params"]
    logits, value = jax.jit(model.apply)({"params": params}, obs)
    assert logits.shape == (5, 3) and value.shape == (5,)
    assert logits.dtype == jnp.float32 and value.dtype == jnp.float32
    gains = {"actor_hidden_0": np.sqrt(2), "actor_hidden_1": np.sqrt(2), "actor_head": 0.01,
             "critic_hidden_0": np.sqrt(2), "critic_hidden_1": np.sqrt(2), "critic_head": 1.0}
    assert sorted(params) == sorted(gains)
    for name, gain in gains.items():
        k = params[name]["kernel"]
        np.testing.assert_allclose(_gram(k), gain**2 * np.eye(min(k.shape)), atol=1e-5)
        np.testing.assert_array_equal(params[name]["bias"], 0.0)
    # A near-uniform initial policy.
    assert np.abs(np.asarray(logits)).max() < 0.1


def test_actor_critic_vmap_and_extra_batch_dims():
    # Same parameter tree as the tanh model; only the activation differs.
    model = ActorCritic(num_actions=3, activation="relu")
    obs = jax.random.normal(jax.random.key(1), (3, 7, 4))
    params = _actor_critic_params()
    logits, value = jax.jit(model.apply)(params, obs)
    v_logits, v_value = jax.jit(jax.vmap(model.apply, in_axes=(None, 0)))(params, obs)
    assert logits.shape == (3, 7, 3) and value.shape == (3, 7)
    tanh_logits, _ = jax.jit(ActorCritic(num_actions=3).apply)(params, obs)
    assert not np.allclose(tanh_logits, logits)
    np.testing.assert_allclose(v_logits, logits, rtol=1e-6)
    np.testing.assert_allclose(v_value, value, rtol=1e-6)


def test_gaussian_actor_critic():
    model = GaussianActorCritic(action_dim=2, hidden_sizes=(16,))
    obs = jnp.ones((4, 3))
    params = jax.jit(model.init)(jax.random.key(0), obs)
    mean, log_std, value = jax.jit(model.apply)(params, obs)
    assert mean.shape == log_std.shape == (4, 2) and value.shape == (4,)
    np.testing.assert_array_equal(log_std, 0.0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_actions=0), "num_actions"),
    (dict(num_actions=2, activation="sigmoid"), "activation"),
    (dict(num_actions=2, hidden_sizes=(0,)), "hidden_sizes")])
def test_bad_arguments_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ActorCritic(**kwargs).init(jax.random.key(0), jnp.ones((1, 2)))


def test_value_only_clone_returns_the_critic_value_with_the_same_params():
    model = ActorCritic(num_actions=3)
    params = _actor_critic_params()
    obs = jax.random.normal(jax.random.key(2), (6, 4))
    _, value = jax.jit(model.apply)(params, obs)
    only = jax.jit(model.clone(value_only=True).apply)(params, obs)
    np.testing.assert_allclose(only, value, rtol=1e-6)
    assert only.shape == (6,)

"""The gymnax adapter steps exactly as gymnax does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gymnax = pytest.importorskip("gymnax")

import arl.envs as E  # noqa: E402
from arl.envs.gymnax_adapter import GymnaxEnvironment  # noqa: E402

BATCH, STEPS = 16, 120


@pytest.mark.parametrize("name", [
    "CartPole-v1", pytest.param("Acrobot-v1", marks=pytest.mark.slow)])
def test_auto_reset_adapter_matches_gymnax_step(name):
    """AutoReset(adapter) against gymnax's own auto-resetting step over
    random actions, with a short time limit so truncation happens too."""
    raw, raw_params = gymnax.make(name)
    params = raw_params.replace(max_steps_in_episode=25)
    ours = E.AutoReset(E.make(f"gymnax:{name}"))
    num_actions = raw.action_space(params).n

    def run_gymnax(key):
        keys = jax.random.split(key, BATCH)
        obs, state = jax.vmap(raw.reset, in_axes=(0, None))(keys, params)

        def body(state, key):
            k_act, k_step = jax.random.split(key)
            action = jax.random.randint(k_act, (BATCH,), 0, num_actions)
            out = jax.vmap(raw.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k_step, BATCH), state, action, params)
            return out[1], (out[0], out[2], out[3], out[4], out[5]["final_observation"])

        return obs, jax.lax.scan(body, state, jax.random.split(key, STEPS))[1]

    def run_ours(key):
        keys = jax.random.split(key, BATCH)
        state, ts = jax.vmap(ours.reset, in_axes=(0, None))(keys, params)

        def body(state, key):
            k_act, k_step = jax.random.split(key)
            action = jax.random.randint(k_act, (BATCH,), 0, num_actions)
            state, ts = jax.vmap(ours.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k_step, BATCH), state, action, params)
            return state, (ts.observation, ts.reward, ts.terminated, ts.truncated,
                           ts.info["final_observation"])

        return ts.observation, jax.lax.scan(body, state, jax.random.split(key, STEPS))[1]

    key = jax.random.key(0)
    obs0, expected = jax.jit(run_gymnax)(key)
    ours0, got = jax.jit(run_ours)(key)
    # Same trajectories; floats may differ in the last bit because XLA fuses the two
    # programs differently (gymnax's step is its own jit), flags and rewards exactly.
    np.testing.assert_array_equal(obs0, ours0)
    for a, b in zip(expected, got):
        if np.issubdtype(np.asarray(a).dtype, np.floating):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    terminated, truncated = np.asarray(got[2]), np.asarray(got[3])
    assert truncated.sum() > 0  # both kinds of episode end were exercised
    if name == "CartPole-v1":
        assert terminated.sum() > 0
    assert got[1].dtype == jnp.float32


def test_adapter_without_reset_stays_finished():
    env = E.make("gymnax:CartPole-v1")
    params = env.default_params().replace(max_steps_in_episode=5)
    state, ts = env.reset(jax.random.key(0), params)
    assert set(ts.info) == {"discount", "final_observation"}
    step = jax.jit(env.step)
    for t in range(5):
        state, ts = step(jax.random.key(t), state, jnp.asarray(t % 2), params)
    assert bool(ts.truncated) and not bool(ts.terminated)
    np.testing.assert_array_equal(ts.info["final_observation"], ts.observation)
    frozen, again = step(jax.random.key(9), state, jnp.asarray(1), params)
    jax.tree.map(np.testing.assert_array_equal, frozen, state)
    assert float(again.reward) == 0.0 and bool(again.truncated)
    assert isinstance(env.action_space, E.Discrete) and env.action_space.n == 2
    assert env.observation_space.shape == (4,)


def test_adapter_errors():
    with pytest.raises(ValueError, match="not a gymnax environment"):
        GymnaxEnvironment("NoSuchEnv-v0")

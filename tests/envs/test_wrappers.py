"""VmapWrapper, AutoReset, TurnHorizon and Mixture."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arl.envs as E
from arl.envs.base import TokenChunk

BATCH = 64


def row(chunk, i):
    return TokenChunk(chunk.tokens[i], chunk.length[i])


def constant_action(env, text):
    ids, length = env.codec.encode_padded(text, env.action_len)
    return TokenChunk(jnp.broadcast_to(jnp.asarray(ids), (BATCH, env.action_len)),
                      jnp.full((BATCH,), length, jnp.int32))


def test_vmap_wrapper_batched_and_shared_params():
    env = E.GuessNumber(max_n=100)
    batched = E.batch(env)
    params = E.broadcast_params(env.default_params(), BATCH).replace(
        num_values=jnp.arange(BATCH, dtype=jnp.int32) + 2)
    keys = jax.random.split(jax.random.key(0), BATCH)
    state, ts = jax.jit(batched.reset)(keys, params)
    assert ts.observation.tokens.shape == (BATCH, env.prompt_len)
    assert bool(jnp.all(state.hidden < params.num_values))
    assert env.render_chunk(row(ts.observation, 5)) == "guess 0-6"
    shared = E.batch(env, batched_params=False)
    state2, _ = jax.jit(shared.reset)(keys, env.default_params())
    assert bool(jnp.all(state2.num_values == 100))
    # Attributes of the wrapped env are visible through the wrapper.
    assert batched.action_len == env.action_len and batched.max_turns == env.max_turns


def test_auto_reset_resets_only_finished_rows():
    env = E.GuessNumber()
    wrapped = E.AutoReset(env)
    params = env.default_params()
    assert wrapped.obs_len == wrapped.prompt_len == max(env.prompt_len, env.obs_len)
    keys = jax.random.split(jax.random.key(1), BATCH)
    step_keys = jax.random.split(jax.random.key(2), BATCH)
    reset = jax.jit(jax.vmap(wrapped.reset, in_axes=(0, None)))
    step = jax.jit(jax.vmap(wrapped.step, in_axes=(0, 0, 0, None)))
    inner_step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    inner_reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    state, ts = reset(keys, params)
    assert ts.observation.tokens.shape == (BATCH, wrapped.obs_len)
    action = constant_action(env, "7<eot>")  # correct only where hidden == 7
    new_state, ts = step(step_keys, state, action, params)
    stepped_state, stepped = inner_step(step_keys, state, action, params)
    reset_keys = jax.vmap(lambda k: jax.random.split(k)[1])(step_keys)
    fresh_state, fresh = inner_reset(reset_keys, params)
    done = np.asarray(stepped.done)
    assert done.any() and not done.all()
    np.testing.assert_array_equal(ts.done, done)
    np.testing.assert_array_equal(ts.reward, stepped.reward)
    for got, fresh_leaf, stepped_leaf in zip(jax.tree.leaves(new_state),
                                             jax.tree.leaves(fresh_state),
                                             jax.tree.leaves(stepped_state)):
        np.testing.assert_array_equal(np.asarray(got)[done], np.asarray(fresh_leaf)[done])
        np.testing.assert_array_equal(np.asarray(got)[~done], np.asarray(stepped_leaf)[~done])
    for i in range(8):
        final = env.render_chunk(row(ts.info["final_observation"], i))
        assert final == ("correct" if done[i] else env.render_chunk(row(stepped.observation, i)))
        shown = env.render_chunk(row(ts.observation, i))
        assert shown == ("guess 0-15" if done[i] else final)


def test_turn_horizon_is_data_and_truncates():
    env = E.TurnHorizon(E.GuessNumber())
    params = env.default_params(horizon=2)
    assert int(params.horizon) == 2
    keys = jax.random.split(jax.random.key(3), BATCH)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    garbage = constant_action(env, "x<eot>")  # never solves, so only limits end episodes
    for horizon in [1, 2, 3, 5]:
        params = params.replace(horizon=jnp.asarray(horizon, jnp.int32))
        state, _ = reset(keys, params)
        for turn in range(1, 7):
            old = state
            state, ts = step(keys, state, garbage, params)
            expected_trunc = turn >= horizon
            assert bool(jnp.all(ts.truncated == expected_trunc)), (horizon, turn)
            assert not bool(jnp.any(ts.terminated))
            if turn > horizon:  # already finished: a no-op
                assert bool(jnp.all(ts.reward == 0)) and bool(jnp.all(ts.observation.length == 0))
                jax.tree.map(np.testing.assert_array_equal, old, state)
            else:
                assert np.allclose(ts.reward, -0.15)
    # A curriculum changes h without recompiling.
    assert step._cache_size() == 1
    # The inner env's own limit (max_turns = 6) still applies under a larger horizon.
    params = params.replace(horizon=jnp.asarray(100, jnp.int32))
    state, _ = reset(keys, params)
    for turn in range(1, 7):
        state, ts = step(keys, state, garbage, params)
    assert bool(jnp.all(ts.truncated))


def small_mixture():
    """Two kinds and two difficulties: cheap to compile for the default suite."""
    return E.Mixture([E.GuessNumber(max_n=16), E.Bandit(), E.GuessNumber(max_n=100)])


def full_mixture():
    return E.Mixture([E.GuessNumber(max_n=16), E.Calculator(), E.FrozenLake(), E.Bandit(),
                      E.GuessNumber(max_n=100)])


@pytest.fixture(scope="module")
def mixture():
    return full_mixture()


def test_mixture_static_shapes(mixture):
    members = mixture.envs
    assert mixture.prompt_len == max(m.prompt_len for m in members)
    assert mixture.obs_len == max(m.obs_len for m in members)
    assert mixture.action_len == max(m.action_len for m in members)
    assert mixture.max_turns == max(m.max_turns for m in members)
    with pytest.raises(ValueError, match="at least one"):
        E.Mixture([])
    with pytest.raises(ValueError, match="env_id"):
        mixture.default_params(env_id=5)


@pytest.mark.parametrize("make_mixture", [
    small_mixture, pytest.param(full_mixture, marks=pytest.mark.slow)])
def test_mixture_keeps_ids_and_rewards_straight(make_mixture):
    mixture = make_mixture()
    bandit_id = [type(m).__name__ for m in mixture.envs].index("Bandit")
    env_ids = jnp.arange(BATCH, dtype=jnp.int32) % mixture.num_envs
    params = mixture.batch_params(env_ids)
    keys = jax.random.split(jax.random.key(4), BATCH)
    reset = jax.jit(jax.vmap(mixture.reset))
    step = jax.jit(jax.vmap(mixture.step))
    oracle = jax.jit(jax.vmap(mixture.oracle_action))
    state, ts = reset(keys, params)
    np.testing.assert_array_equal(ts.info["env_id"], env_ids)
    assert ts.observation.tokens.shape == (BATCH, mixture.prompt_len)
    # Each row against its member run alone with the same keys and actions.
    member_reset = [jax.jit(jax.vmap(m.reset, in_axes=(0, None))) for m in mixture.envs]
    member_step = [jax.jit(jax.vmap(m.step, in_axes=(0, 0, 0, None))) for m in mixture.envs]
    member_states = []
    ids = np.asarray(env_ids)
    for i, member in enumerate(mixture.envs):
        s, t = member_reset[i](keys, member.default_params())
        member_states.append(s)
        rows = ids == i
        np.testing.assert_array_equal(np.asarray(ts.observation.length)[rows],
                                      np.asarray(t.observation.length)[rows])
        np.testing.assert_array_equal(
            np.asarray(ts.observation.tokens)[rows][:, :member.prompt_len],
            np.asarray(t.observation.tokens)[rows])
    total = jnp.zeros(BATCH)
    for turn in range(mixture.max_turns):
        step_keys = jax.random.split(jax.random.fold_in(keys[0], turn), BATCH)
        action = oracle(step_keys, state, params)
        state, ts = step(step_keys, state, action, params)
        np.testing.assert_array_equal(ts.info["env_id"], env_ids)
        total = total + ts.reward
        for i, member in enumerate(mixture.envs):
            s, t = member_step[i](step_keys, member_states[i], action, member.default_params())
            member_states[i] = s
            rows = ids == i
            np.testing.assert_array_equal(np.asarray(ts.reward)[rows], np.asarray(t.reward)[rows])
            np.testing.assert_array_equal(np.asarray(ts.done)[rows], np.asarray(t.done)[rows])
            np.testing.assert_array_equal(np.asarray(ts.info["success"])[rows],
                                          np.asarray(t.info["success"])[rows])
    deterministic = np.asarray(env_ids) != bandit_id
    assert bool(jnp.all(ts.info["success"]))  # oracles solve every member (bandit: best arm)
    np.testing.assert_array_less(0.6, np.asarray(total)[deterministic])
    # Reward bounds dispatch per row too.
    low, high = jax.vmap(mixture.reward_bounds)(params)
    np.testing.assert_allclose(high[bandit_id], 1.0)
    np.testing.assert_allclose(high[0], 0.95)


def test_mixture_state_is_a_scan_carry(mixture):
    params = mixture.batch_params(jnp.arange(BATCH, dtype=jnp.int32) % mixture.num_envs)
    keys = jax.random.split(jax.random.key(5), BATCH)
    state, _ = jax.eval_shape(jax.vmap(mixture.reset), keys, params)
    action = TokenChunk(jnp.zeros((BATCH, mixture.action_len), jnp.int32),
                        jnp.zeros((BATCH,), jnp.int32))
    state2, ts2 = jax.eval_shape(jax.vmap(mixture.step), keys, state, action, params)
    sig = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype, x.weak_type), t)  # noqa: E731
    assert sig(state) == sig(state2)
    assert ts2.observation.tokens.shape == (BATCH, mixture.obs_len)

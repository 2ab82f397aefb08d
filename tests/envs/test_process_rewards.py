"""Process rewards: `info["process_reward"]` of every token env, the guess_number /
frozen_lake / calculator formulas, and their passage through the wrappers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arl.envs as E
from arl.envs.base import TokenChunk

CODEC = E.CharCodec()
BATCH = 64


def chunk(text, length=32):
    ids, n = CODEC.encode_padded(text, length)
    return TokenChunk(jnp.asarray(ids), jnp.asarray(n, jnp.int32))


def batch_chunks(texts, length=32):
    rows = [CODEC.encode_padded(t, length) for t in texts]
    return TokenChunk(jnp.asarray(np.stack([r[0] for r in rows])),
                      jnp.asarray([r[1] for r in rows], jnp.int32))


_JIT = {}


def jitted(env):
    """(reset, step, oracle, demonstrator) of one env, jitted and vmapped (params shared),
    compiled once per env object in this module."""
    if id(env) not in _JIT:
        _JIT[id(env)] = (
            env,
            jax.jit(jax.vmap(env.reset, in_axes=(0, None))),
            jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None))),
            jax.jit(jax.vmap(env.oracle_action, in_axes=(0, 0, None))),
            jax.jit(jax.vmap(env.demonstrator_action, in_axes=(0, 0, None))),
        )
    return _JIT[id(env)][1:]


_ENVS = {}


def get_env(name):
    if name not in _ENVS:
        _ENVS[name] = E.make(name)
    return _ENVS[name]


def play(env, key, params, policy="oracle", turns=None):
    """Python loop of `turns` (default max_turns + 2, so finished no-op steps are seen)
    over a BATCH of episodes; returns (per-step timesteps, final state)."""
    reset, step, oracle, demo = jitted(env)
    act = oracle if policy == "oracle" else demo
    key_reset, key = jax.random.split(key)
    state, first = reset(jax.random.split(key_reset, BATCH), params)
    assert bool(jnp.all(first.info["process_reward"] == 0))
    steps = []
    for _ in range(env.max_turns + 2 if turns is None else turns):
        key, key_act, key_step = jax.random.split(key, 3)
        action = act(jax.random.split(key_act, BATCH), state, params)
        state, ts = step(jax.random.split(key_step, BATCH), state, action, params)
        steps.append(ts)
    return steps, state


def process_rewards(steps):
    return np.stack([np.asarray(ts.info["process_reward"]) for ts in steps], 1)  # [B, T]


def noop_mask(steps):
    """[B, T] True where the step was a finished episode's no-op (done before it)."""
    done = np.stack([np.asarray(ts.done) for ts in steps], 1)
    before = np.zeros_like(done)
    before[:, 1:] = np.logical_or.accumulate(done, axis=1)[:, :-1]
    return before


# ------------------------------------------------------------------------- contract


@pytest.mark.parametrize("name", E.registered_names())
def test_every_registered_env_reports_a_float32_process_reward(name):
    """Present on reset and step, float32 [], not weak (a scan carry), under jit + vmap,
    same info structure on reset and step; 0 on reset."""
    env = get_env(name)
    params = env.default_params()
    key = jax.random.key(0)
    # Traced, not run: an eager reset of the larger envs costs seconds of op dispatch.
    _, ts = jax.eval_shape(env.reset, key, params)
    assert ts.info["process_reward"].shape == () and ts.info["process_reward"].dtype == jnp.float32
    assert not ts.info["process_reward"].weak_type
    batched = E.batch(env, batched_params=False)
    keys = jax.random.split(key, 8)
    state, ts0 = jax.jit(batched.reset)(keys, params)
    assert np.all(np.asarray(ts0.info["process_reward"]) == 0.0)
    action = jax.jit(jax.vmap(env.oracle_action, in_axes=(0, 0, None)))(keys, state, params)
    _, ts1 = jax.jit(batched.step)(keys, state, action, params)

    def signature(tree):
        return jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", False)), tree)

    assert signature(ts0.info) == signature(ts1.info)
    assert ts1.info["process_reward"].shape == (8,)
    assert ts1.info["process_reward"].dtype == jnp.float32
    assert not jax.eval_shape(lambda: ts1.info["process_reward"]).weak_type
    assert bool(jnp.all(jnp.isfinite(ts1.info["process_reward"])))


def test_process_reward_is_not_part_of_the_reward():
    env = get_env("guess_number")
    params = env.default_params()
    state, _ = env.reset(jax.random.key(0), params)
    state = state.replace(hidden=jnp.asarray(11, jnp.int32))
    _, ts = jax.jit(env.step)(jax.random.key(1), state, chunk("7<eot>"), params)
    assert float(ts.info["process_reward"]) == pytest.approx(0.25)
    assert float(ts.reward) == pytest.approx(-0.05)  # only the turn cost


def test_default_hook_is_zero():
    env = get_env("bandit")
    steps, _ = play(env, jax.random.key(0), env.default_params(), policy="demonstrator")
    assert np.all(process_rewards(steps) == 0)


# ---------------------------------------------------------------------- guess_number


def test_guess_number_hand_computed_episode():
    """N = 16, hidden 11. Interval sizes: 16 -> 8 ([8,15]) -> 5 ([8,12]) -> 5 -> 5 -> 5
    -> found (1); then finished."""
    env = get_env("guess_number")
    params = env.default_params()
    step = jax.jit(env.step)
    state, _ = env.reset(jax.random.key(0), params)
    state = state.replace(hidden=jnp.asarray(11, jnp.int32))
    log = math.log
    cases = [
        ("7<eot>", log(16 / 8) / log(16), False),   # higher: [8, 15]
        ("13<eot>", log(8 / 5) / log(16), False),   # lower: [8, 12]
        ("x<eot>", 0.0, True),                       # malformed
        ("20<eot>", 0.0, True),                      # out of range
        ("3<eot>", 0.0, False),                      # valid but outside the interval
        ("11<eot>", log(5) / log(16), False),        # correct: the interval collapses
        ("11<eot>", 0.0, False),                     # finished: a no-op
    ]
    total = 0.0
    for t, (text, expected, error) in enumerate(cases):
        state, ts = step(jax.random.key(t), state, chunk(text), params)
        got = float(ts.info["process_reward"])
        assert got == pytest.approx(expected, abs=1e-6), text
        assert bool(ts.info["format_error"]) == error, text
        total += got
    assert bool(ts.info["success"]) and bool(ts.done)
    assert total == pytest.approx(1.0, abs=1e-6)
    # Also the hook itself, called directly.
    s0, _ = env.reset(jax.random.key(0), params)
    s0 = s0.replace(hidden=jnp.asarray(11, jnp.int32))
    s1, _ = step(jax.random.key(0), s0, chunk("7<eot>"), params)
    assert float(env.process_reward(s0, s1, params)) == pytest.approx(0.25)


def test_guess_number_oracle_and_demonstrator_episodes_sum_to_one():
    """Any episode that finds the number collects exactly 1 (telescoping), for each N;
    finished no-op steps collect 0; a truncated episode collects less than 1."""
    env = get_env("guess_number")
    for num_values in (2, 7, 16):
        params = env.default_params(num_values=num_values)
        for policy in ("oracle", "demonstrator"):
            steps, state = play(env, jax.random.key(num_values), params, policy=policy)
            rewards = process_rewards(steps)
            success = np.asarray(state.success)
            assert np.all(rewards >= -1e-7)
            assert np.all(rewards[noop_mask(steps)] == 0)
            if policy == "oracle":
                assert success.all()
            np.testing.assert_allclose(rewards.sum(1)[success], 1.0, atol=1e-5)
            if (~success).any():
                assert np.all(rewards.sum(1)[~success] < 1.0 - 1e-3)
    # The first bisection guess always gains information, at most all of it.
    steps, _ = play(env, jax.random.key(5), env.default_params(), turns=1, policy="oracle")
    first = process_rewards(steps)[:, 0]
    assert np.all((first > 0) & (first <= 1.0 + 1e-6))


# ----------------------------------------------------------------------- frozen_lake


def test_frozen_lake_hand_computed_moves():
    """4x4, start 0, hole at 1, goal at 15: d(start) = 6."""
    env = get_env("frozen_lake")
    params = env.default_params()
    step = jax.jit(env.step)
    cells = np.zeros(16, np.int32)
    cells[1], cells[15] = 1, 2
    state, _ = env.reset(jax.random.key(0), params)
    state = env.place(state, cells, 0)
    assert int(state.start_distance) == 6
    cases = [
        ("Left", 0, 0.0),      # wall: no move
        ("x", 0, 0.0),         # malformed
        ("Down", 4, 1 / 6),    # d 6 -> 5
        ("Up", 0, -1 / 6),     # back: d 5 -> 6
        ("Down", 4, 1 / 6),
        ("Down", 8, 1 / 6),
        ("Right", 9, 1 / 6),
        ("Right", 10, 1 / 6),
        ("Down", 14, 1 / 6),
        ("Right", 15, 1 / 6),  # the goal
        ("Right", 15, 0.0),    # finished: a no-op
    ]
    total = 0.0
    for t, (text, position, expected) in enumerate(cases):
        state, ts = step(jax.random.key(t), state, chunk(text + "<eot>"), params)
        assert int(state.position) == position, text
        got = float(ts.info["process_reward"])
        assert got == pytest.approx(expected, abs=1e-6), (t, text)
        total += got
    assert bool(ts.info["success"])
    assert total == pytest.approx(1.0, abs=1e-6)
    # Into the hole: 0, episode over.
    fresh = env.place(state, cells, 0).replace(terminated=jnp.asarray(False),
                                               success=jnp.asarray(False),
                                               turn=jnp.asarray(0, jnp.int32))
    hole_state, ts = step(jax.random.key(0), fresh, chunk("Right<eot>"), params)
    assert int(hole_state.position) == 1 and bool(ts.terminated)
    assert float(ts.info["process_reward"]) == 0.0


def test_frozen_lake_slippery_reward_is_the_realised_progress():
    """Slip probability 1 from cell 5 pressing Down: the player lands on 4 (d 5, away
    from the goal at 15) or 6 (d 3, closer); d(start = 5) = 4."""
    env = get_env("frozen_lake")
    _, step, _, _ = jitted(env)
    params = env.default_params(hole_prob=0.0, slip_prob=1.0)
    state, _ = env.reset(jax.random.key(0), params)
    state = env.place(state, jnp.zeros(16, jnp.int32).at[15].set(2), 5)
    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH,) + x.shape), state)
    actions = batch_chunks(["Down<eot>"] * BATCH)
    new, ts = step(jax.random.split(jax.random.key(3), BATCH), states, actions, params)
    positions = np.asarray(new.position)
    reward = np.asarray(ts.info["process_reward"])
    assert set(positions.tolist()) == {4, 6}
    np.testing.assert_allclose(reward[positions == 4], -0.25)
    np.testing.assert_allclose(reward[positions == 6], 0.25)


def test_frozen_lake_successful_episodes_sum_to_one():
    """Non-slippery oracle (shortest path): every row succeeds and collects 1, in
    d(start) equal steps; a noisy demonstrator's successful rows also collect 1."""
    env = get_env("frozen_lake")
    params = env.default_params(hole_prob=0.3)
    steps, state = play(env, jax.random.key(7), params, policy="oracle")
    rewards = process_rewards(steps)
    assert bool(jnp.all(state.success))
    np.testing.assert_allclose(rewards.sum(1), 1.0, atol=1e-5)
    live = ~noop_mask(steps)
    d_start = np.asarray(state.start_distance)[:, None]
    np.testing.assert_allclose(np.where(live, rewards, 0), np.where(live, 1.0 / d_start, 0),
                               rtol=1e-6)
    assert np.all(rewards[~live] == 0)
    steps, state = play(env, jax.random.key(8), params, policy="demonstrator")
    rewards = process_rewards(steps)
    success = np.asarray(state.success)
    assert success.any()
    np.testing.assert_allclose(rewards.sum(1)[success], 1.0, atol=1e-5)
    assert np.all(rewards[noop_mask(steps)] == 0)


# ------------------------------------------------------------------------ calculator


def test_calculator_process_reward_when_the_answer_first_appears():
    env = get_env("calculator")
    params = env.default_params()
    step = jax.jit(env.step)
    state, _ = env.reset(jax.random.key(0), params)
    state = state.replace(left=jnp.asarray(47, jnp.int32), right=jnp.asarray(86, jnp.int32),
                          operator=jnp.asarray(2, jnp.int32), answer=jnp.asarray(4042, jnp.int32))
    one = {
        "<calc>86*47</calc><eot>": 1.0,      # same value, other expression
        "<calc>1+1</calc><eot>": 0.0,         # a tool call that does not help
        "<answer>4042</answer><eot>": 1.0,   # correct without the tool
        "<answer>4041</answer><eot>": 0.0,   # wrong
        "<foo>1</foo><eot>": 0.0,             # unknown tool
        "junk<eot>": 0.0,
    }
    for text, expected in one.items():
        _, ts = step(jax.random.key(0), state, chunk(text), params)
        assert float(ts.info["process_reward"]) == expected, text
    # Tool first, then the answer: 1 then 0 (the answer was already known); then no-op.
    total = []
    s = state
    for text in ["<calc>47*86</calc><eot>", "<calc>47*86</calc><eot>",
                 "<answer>4042</answer><eot>", "<answer>4042</answer><eot>"]:
        s, ts = step(jax.random.key(0), s, chunk(text), params)
        total.append(float(ts.info["process_reward"]))
    assert total == [1.0, 0.0, 0.0, 0.0] and bool(ts.info["success"])
    steps, final = play(env, jax.random.key(2), params, policy="demonstrator")
    rewards = process_rewards(steps)
    success = np.asarray(final.success)
    np.testing.assert_allclose(rewards.sum(1)[success], 1.0)
    assert np.all(rewards[noop_mask(steps)] == 0)


# -------------------------------------------------------------------------- wrappers


def test_auto_reset_and_vmap_pass_the_finishing_step_through():
    env = E.GuessNumber(max_n=16)
    wrapped = E.AutoReset(env)
    params = env.default_params()
    keys = jax.random.split(jax.random.key(1), BATCH)
    state, ts = jax.jit(E.batch(wrapped, batched_params=False).reset)(keys, params)
    assert bool(jnp.all(ts.info["process_reward"] == 0))
    action = batch_chunks(["7<eot>"] * BATCH, env.action_len)
    new_state, ts = jax.jit(E.batch(wrapped, batched_params=False).step)(
        keys, state, action, params)
    _, inner = jax.jit(E.batch(env, batched_params=False).step)(keys, state, action, params)
    np.testing.assert_array_equal(ts.info["process_reward"], inner.info["process_reward"])
    hidden = np.asarray(state.hidden)
    expected = np.where(hidden == 7, 1.0,
                        np.where(hidden > 7, math.log(2) / math.log(16),
                                 math.log(16 / 7) / math.log(16)))
    np.testing.assert_allclose(ts.info["process_reward"], expected, rtol=1e-6)


def test_turn_horizon_zeroes_process_reward_once_finished():
    env = E.TurnHorizon(E.GuessNumber(max_n=16))
    params = env.default_params(horizon=2)
    keys = jax.random.split(jax.random.key(3), BATCH)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    oracle = jax.jit(jax.vmap(lambda k, s, p: env.env.oracle_action(k, s.env_state, p),
                              in_axes=(0, 0, None)))
    state, ts = reset(keys, params)
    assert ts.info["process_reward"].dtype == jnp.float32
    steps = []
    for turn in range(4):
        action = oracle(keys, state, params.env_params)
        state, ts = step(keys, state, action, params)
        steps.append(ts)
    rewards, noop = process_rewards(steps), noop_mask(steps)
    assert np.all(rewards[~noop] > 0)  # bisection always gains information
    assert np.all(rewards[noop] == 0)  # and nothing once finished
    assert np.all(noop[:, 2:]) and noop[:, 1].any() and not noop[:, 1].all()
    assert bool(jnp.all(ts.done))


@pytest.mark.slow  # default-suite budget (~25 s on a quiet machine)
def test_mixture_keeps_a_fixed_info_and_each_members_process_reward():
    members = [E.GuessNumber(max_n=16), E.FrozenLake(), E.Bandit()]
    mixture = E.Mixture(members)
    env_ids = jnp.arange(BATCH, dtype=jnp.int32) % len(members)
    params = mixture.batch_params(env_ids)
    keys = jax.random.split(jax.random.key(4), BATCH)
    reset = jax.jit(jax.vmap(mixture.reset))
    step = jax.jit(jax.vmap(mixture.step))
    oracle = jax.jit(jax.vmap(mixture.oracle_action))
    hook = jax.jit(jax.vmap(mixture.process_reward))
    state, ts = reset(keys, params)
    assert set(ts.info) == {"success", "turn", "format_error", "process_reward", "env_id"}
    assert ts.info["process_reward"].dtype == jnp.float32
    member_state = []
    for i, m in enumerate(members):
        s, _ = jax.jit(jax.vmap(m.reset, in_axes=(0, None)))(keys, m.default_params())
        member_state.append(s)
    member_step = [jax.jit(jax.vmap(m.step, in_axes=(0, 0, 0, None))) for m in members]
    ids = np.asarray(env_ids)
    totals = np.zeros(BATCH)
    for turn in range(mixture.max_turns):
        step_keys = jax.random.split(jax.random.fold_in(keys[0], turn), BATCH)
        action = oracle(step_keys, state, params)
        old = state
        state, ts = step(step_keys, state, action, params)
        assert set(ts.info) == {"success", "turn", "format_error", "process_reward", "env_id"}
        got = np.asarray(ts.info["process_reward"])
        direct = np.asarray(hook(old, state, params))
        totals += got
        for i, m in enumerate(members):
            s, t = member_step[i](step_keys, member_state[i], action, m.default_params())
            member_state[i] = s
            rows = ids == i
            np.testing.assert_array_equal(got[rows], np.asarray(t.info["process_reward"])[rows])
        # The dispatched hook agrees wherever the row's episode was live.
        was_live = ~np.asarray(old_done(old, ids, len(members)))
        np.testing.assert_allclose(direct[was_live], got[was_live], rtol=1e-6)
    np.testing.assert_allclose(totals[ids != 2], 1.0, atol=1e-5)  # oracles succeed
    np.testing.assert_array_equal(totals[ids == 2], 0.0)


def old_done(state, ids, num_members):
    done = [np.asarray(s.terminated | s.truncated) for s in state.member_states]
    return np.choose(ids, done)

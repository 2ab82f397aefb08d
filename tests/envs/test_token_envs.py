"""Every token environment: jit + vmap, determinism, oracle optimality, fuzzing."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arl.envs as E
from arl.envs.base import TokenChunk

NAMES = ["guess_number", "calculator", "frozen_lake", "bandit", "dataset_task"]
# Constructor kwargs where the defaults would leave a path untested: dataset_task's
# default is one attempt; three exercise the "wrong, try again" turns.
KWARGS = {"dataset_task": {"max_turns": 3}}
CODEC = E.CharCodec()


BATCH = 256  # one batch size everywhere: each env compiles reset/step/oracle once


class Runner:
    """Jitted, vmapped reset / step / oracle of one env at batch BATCH (compiled once
    per module; params are data, so tests vary them without recompiling)."""

    def __init__(self, env):
        self.env = env
        self.params = env.default_params()
        self.reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
        self.step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
        self.oracle = jax.jit(jax.vmap(env.oracle_action, in_axes=(0, 0, None)))
        self.demo = jax.jit(jax.vmap(env.demonstrator_action, in_axes=(0, 0, None)))

    def rollout(self, key, params=None, policy="oracle"):
        """Python loop over max_turns (tests only); returns per-turn timesteps."""
        params = self.params if params is None else params
        key_reset, key = jax.random.split(key)
        state, first = self.reset(jax.random.split(key_reset, BATCH), params)
        act = self.oracle if policy == "oracle" else self.demo
        steps = []
        for _ in range(self.env.max_turns):
            key, key_act, key_step = jax.random.split(key, 3)
            action = act(jax.random.split(key_act, BATCH), state, params)
            state, ts = self.step(jax.random.split(key_step, BATCH), state, action, params)
            steps.append(ts)
        return first, steps, state

    def step_cases(self, state, texts, params=None, key=jax.random.key(1)):
        """Step ONE state with each action text (rows of the fixed batch)."""
        params = self.params if params is None else params
        assert len(texts) <= BATCH
        rows = [CODEC.encode_padded(t, 32) for t in texts]
        rows += [rows[-1]] * (BATCH - len(rows))
        actions = TokenChunk(jnp.asarray(np.stack([r[0] for r in rows])),
                             jnp.asarray([r[1] for r in rows], jnp.int32))
        states = jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH,) + x.shape), state)
        keys = jax.random.split(key, BATCH)
        new_states, ts = self.step(keys, states, actions, params)
        return [(jax.tree.map(lambda x: x[i], new_states), jax.tree.map(lambda x: x[i], ts))
                for i in range(len(texts))]

    def one_state(self, params=None, key=jax.random.key(0)):
        params = self.params if params is None else params
        state, _ = self.reset(jax.random.split(key, BATCH), params)
        return jax.tree.map(lambda x: x[0], state)


def row(chunk_batch, i):
    return TokenChunk(chunk_batch.tokens[i], chunk_batch.length[i])


_RUNNERS = {}


def get_runner(name):
    if name not in _RUNNERS:
        _RUNNERS[name] = Runner(E.make(name, **KWARGS.get(name, {})))
    return _RUNNERS[name]


@pytest.fixture(params=NAMES)
def runner(request):
    return get_runner(request.param)


@pytest.fixture
def runners():
    return {name: get_runner(name) for name in NAMES}


def test_shapes_dtypes_and_scan_carry(runner):
    env = runner.env
    keys = jax.random.split(jax.random.key(0), BATCH)
    state, ts = runner.reset(keys, runner.params)
    assert ts.observation.tokens.shape == (BATCH, env.prompt_len)
    assert ts.observation.tokens.dtype == jnp.int32 and ts.reward.dtype == jnp.float32
    assert ts.terminated.dtype == jnp.bool_ and ts.truncated.dtype == jnp.bool_
    for key in ("success", "turn", "format_error"):
        assert ts.info[key].shape == (BATCH,)
    assert ts.info["turn"].dtype == jnp.int32
    # The rollout runs step inside lax.scan: state and step timestep must be a fixed
    # point of shapes, dtypes AND weak types (a scan carry).
    action = runner.oracle(keys, state, runner.params)
    state_shape, ts_shape = jax.eval_shape(runner.step, keys, state, action, runner.params)
    state2_shape, ts2_shape = jax.eval_shape(runner.step, keys, state_shape, action, runner.params)

    def signature(tree):
        return jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", False)), tree)

    assert signature(state_shape) == signature(jax.eval_shape(lambda: state))
    assert signature((state2_shape, ts2_shape)) == signature((state_shape, ts_shape))
    assert ts_shape.observation.tokens.shape == (BATCH, env.obs_len)
    assert action.tokens.shape == (BATCH, env.action_len)


def test_determinism_and_group_semantics(runner):
    keys = jax.random.split(jax.random.key(3), BATCH)
    s1, t1 = runner.reset(keys, runner.params)
    s2, t2 = runner.reset(keys, runner.params)
    jax.tree.map(np.testing.assert_array_equal, (s1, t1), (s2, t2))
    assert any(bool(jnp.any(leaf != leaf[0])) for leaf in jax.tree.leaves(s1))  # tasks vary
    # The same reset key gives the same task (a GRPO group); other keys vary it.
    same = jnp.stack([keys[0]] * BATCH)
    s3, t3 = runner.reset(same, runner.params)
    assert bool(jnp.all(t3.observation.tokens == t3.observation.tokens[0]))
    for leaf in jax.tree.leaves(s3):
        assert bool(jnp.all(leaf == leaf[0]))
    action = runner.oracle(keys, s1, runner.params)
    a1 = runner.step(keys, s1, action, runner.params)
    a2 = runner.step(keys, s1, action, runner.params)
    jax.tree.map(np.testing.assert_array_equal, a1, a2)


def test_fuzz_random_actions(runner):
    """40 steps x 256 rows = 10,240 random turns under jit: no NaN, rewards in bounds,
    finished stays finished, truncation at max_turns. Half the rows get uniform garbage
    (ids outside the vocabulary and lengths outside [0, L] included); half get the
    oracle's action with random corruptions, so valid branches run too. Rows restart
    with a fresh task when done so every step exercises live episodes."""
    env, params = runner.env, runner.params
    low, high = (float(b) for b in env.reward_bounds(params))
    size = env.action_len

    @jax.jit
    def make_actions(key, oracle):
        k_tok, k_len, k_mask, k_cut = jax.random.split(key, 4)
        garbage = jax.random.randint(k_tok, (BATCH, size), -3, env.codec.vocab_size + 3)
        lengths = jax.random.randint(k_len, (BATCH,), -2, size + 3)
        corrupted = jnp.where(jax.random.bernoulli(k_mask, 0.08, (BATCH, size)), garbage,
                              oracle.tokens)
        cut = jnp.where(jax.random.bernoulli(k_cut, 0.2, (BATCH,)), lengths, oracle.length)
        use_garbage = (jnp.arange(BATCH) % 2) == 0
        return TokenChunk(jnp.where(use_garbage[:, None], garbage, corrupted),
                          jnp.where(use_garbage, lengths, cut))

    key = jax.random.key(7)
    state, _ = runner.reset(jax.random.split(key, BATCH), params)
    saw_valid = saw_error = checked_finished = 0
    for t in range(40):
        key, k_act, k_oracle, k_step, k_reset = jax.random.split(key, 5)
        oracle = runner.oracle(jax.random.split(k_oracle, BATCH), state, params)
        action = make_actions(k_act, oracle)
        was_done = np.asarray(state.terminated | state.truncated)
        old_state = state
        state, ts = runner.step(jax.random.split(k_step, BATCH), state, action, params)
        reward = np.asarray(ts.reward)
        assert np.all(np.isfinite(reward))
        assert reward.min() >= low - 1e-6 and reward.max() <= high + 1e-6
        # Finished rows: unchanged state, zero reward, empty observation, same flags.
        for old, new in zip(jax.tree.leaves(old_state), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(old)[was_done], np.asarray(new)[was_done])
        assert np.all(reward[was_done] == 0)
        assert np.all(np.asarray(ts.observation.length)[was_done] == 0)
        assert np.all(np.asarray(ts.done)[was_done])
        checked_finished += int(was_done.sum())
        turn = np.asarray(ts.info["turn"])
        assert turn.max() <= env.max_turns
        assert np.all(np.asarray(ts.done)[turn == env.max_turns])
        assert not np.any(np.asarray(ts.terminated) & np.asarray(ts.truncated))
        live = ~was_done
        error = np.asarray(ts.info["format_error"])
        saw_error += int(error[live].sum())
        saw_valid += int((~error[live]).sum())
        length = np.asarray(ts.observation.length)
        assert np.all((length >= 0) & (length <= env.obs_len))
        assert np.all(length[live] > 0)  # a live step always replies
        if t % 4 == 3:  # restart finished rows (after checking they stayed finished)
            fresh, _ = runner.reset(jax.random.split(k_reset, BATCH), params)
            done = state.terminated | state.truncated
            state = jax.tree.map(lambda a, b: jnp.where(
                done.reshape(done.shape + (1,) * (a.ndim - 1)), a, b), fresh, state)
    assert saw_valid > 100 and saw_error > 1000 and checked_finished > 100


def test_oracle_solves_deterministic_envs(runners):
    for name in ["guess_number", "calculator", "frozen_lake"]:
        _, steps, state = runners[name].rollout(jax.random.key(11))
        assert bool(jnp.all(state.success)), name
        assert bool(jnp.all(state.terminated)), name
        assert not any(bool(jnp.any(ts.info["format_error"])) for ts in steps), name


def bisection_guesses(hidden, n):
    low, high, count = 0, n - 1, 0
    while True:
        count += 1
        mid = (low + high) // 2
        if mid == hidden:
            return count
        low, high = (mid + 1, high) if hidden > mid else (low, mid - 1)


def test_guess_number_oracle_is_bisection_optimum(runners):
    r = runners["guess_number"]
    n = r.env.max_n
    _, steps, state = r.rollout(jax.random.key(12))
    assert sorted(set(np.asarray(state.hidden).tolist())) == list(range(n))
    # Bisection needs at most ceil(log2(N + 1)) = 5 guesses for N = 16.
    assert int(jnp.max(state.turn)) == math.ceil(math.log2(n + 1)) == 5
    expected = np.array([bisection_guesses(h, n) for h in np.asarray(state.hidden)])
    np.testing.assert_array_equal(np.asarray(state.turn), expected)
    total = sum(np.asarray(ts.reward) for ts in steps)
    np.testing.assert_allclose(total, 1.0 - 0.05 * expected, atol=1e-6)
    # The demonstrator is weaker: more turns on average, never a format error.
    _, demo_steps, demo_state = r.rollout(jax.random.key(12), policy="demo")
    assert float(jnp.mean(demo_state.turn)) > float(jnp.mean(state.turn)) + 0.2
    assert not any(bool(jnp.any(ts.info["format_error"])) for ts in demo_steps)


def test_guess_number_per_row_difficulty_and_prompt():
    env = E.GuessNumber(max_n=100)
    params = E.broadcast_params(env.default_params(), 3).replace(
        num_values=jnp.array([2, 37, 100], jnp.int32))
    state, ts = jax.vmap(env.reset)(jax.random.split(jax.random.key(0), 3), params)
    prompts = [env.render_chunk(row(ts.observation, i)) for i in range(3)]
    assert prompts == ["guess 0-1", "guess 0-36", "guess 0-99"]
    assert bool(jnp.all(state.hidden < params.num_values))
    with pytest.raises(ValueError, match="max_n"):
        E.GuessNumber(max_n=1)
    with pytest.raises(ValueError, match="num_values"):
        env.default_params(num_values=101)


def test_guess_number_replies_and_rewards(runners):
    r = runners["guess_number"]
    env = r.env
    state = r.one_state().replace(hidden=jnp.asarray(9))
    cases = [("3<eot>", "higher", -0.05, False), ("12", "lower", -0.05, False),
             ("", "invalid", -0.15, True), ("16<eot>", "invalid", -0.15, True),
             ("-1<eot>", "invalid", -0.15, True), ("9x<eot>", "invalid", -0.15, True),
             ("<eot>9", "invalid", -0.15, True), ("9<eot>", "correct", 0.95, False)]
    results = r.step_cases(state, [c[0] for c in cases])
    for (action, reply, reward, error), (new_state, ts) in zip(cases, results):
        assert env.render_chunk(ts.observation) == reply, action
        assert float(ts.reward) == pytest.approx(reward), action
        assert bool(ts.info["format_error"]) == error
        assert bool(ts.terminated) == (reply == "correct")
        assert int(ts.info["turn"]) == 1
    # Feedback narrows the consistent interval.
    (s1, _), = r.step_cases(state, ["3"])
    (s2, _), = r.step_cases(s1, ["12"])
    assert (int(s2.low), int(s2.high)) == (4, 11)


def test_calculator_tool_and_answers(runners):
    r = runners["calculator"]
    env = r.env
    state = r.one_state().replace(left=jnp.asarray(47), right=jnp.asarray(86),
                                  operator=jnp.asarray(2), answer=jnp.asarray(4042))
    cases = [("<calc>47*86</calc><eot>", "4042", 0.0, False, False),
             ("<calc>-5-7</calc>", "-12", 0.0, False, False),
             ("<calc>3--4</calc>", "7", 0.0, False, False),
             ("<calc>99999*99999</calc>", "overflow", -0.1, True, False),
             ("<calc>4*</calc>", "bad expression", -0.1, True, False),
             ("<calc>4*5", "invalid", -0.1, True, False),
             ("<sum>4+5</sum>", "unknown tool", -0.1, True, False),
             ("4042", "invalid", -0.1, True, False),
             ("", "invalid", -0.1, True, False),
             ("<answer>40a</answer>", "bad answer", -0.1, True, False),
             ("<answer>4041</answer>", "wrong", 0.0, False, True),
             ("<answer>4042</answer><eot>", "correct", 1.0, False, True)]
    results = r.step_cases(state, [c[0] for c in cases])
    for (action, reply, reward, error, terminated), (_, ts) in zip(cases, results):
        assert env.render_chunk(ts.observation) == reply, action
        assert float(ts.reward) == pytest.approx(reward), action
        assert bool(ts.info["format_error"]) == error, action
        assert bool(ts.terminated) == terminated, action
        assert bool(ts.info["success"]) == (reply == "correct")
        assert int(ts.info["tool_calls"]) == int(reply in ("4042", "-12", "7"))
    # A wrong answer ends the episode for good.
    (done_state, _), = r.step_cases(state, ["<answer>1</answer>"])
    (after, ts), = r.step_cases(done_state, ["<answer>4042</answer>"])
    assert float(ts.reward) == 0.0 and not bool(ts.info["success"])
    assert int(ts.observation.length) == 0 and bool(ts.terminated)


def test_calculator_demonstrator_is_weaker(runners):
    r = runners["calculator"]
    successes, tool_calls = [], []
    for seed in range(4):
        _, _, state = r.rollout(jax.random.key(13 + seed), policy="demo")
        successes.append(np.asarray(state.success))
        tool_calls.append(np.asarray(state.tool_calls))
    # Skips the tool half the time and then errs half the time: about 75% success.
    assert 0.69 < np.mean(successes) < 0.81
    assert abs(np.mean(tool_calls) - 0.5) < 0.06


def bfs_distance(cells, start, size):
    from collections import deque
    dist = {start: 0}
    queue = deque([start])
    while queue:
        cur = queue.popleft()
        if cells[cur] == 2:
            return dist[cur]
        r, c = divmod(cur, size)
        for dr, dc in [(0, -1), (1, 0), (0, 1), (-1, 0)]:
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size:
                nxt = nr * size + nc
                if nxt not in dist and cells[nxt] != 1:
                    dist[nxt] = dist[cur] + 1
                    queue.append(nxt)
    return None


def test_frozen_lake_maps_solvable_and_oracle_shortest(runners):
    r = runners["frozen_lake"]
    env = r.env
    params = env.default_params(hole_prob=0.45)
    first, _, final = r.rollout(jax.random.key(21), params=params)
    key_reset, _ = jax.random.split(jax.random.key(21))
    state, _ = r.reset(jax.random.split(key_reset, BATCH), params)
    cells, starts = np.asarray(state.cells), np.asarray(state.position)
    distances = [bfs_distance(cells[i], starts[i], env.size) for i in range(BATCH)]
    assert all(d is not None for d in distances)
    assert np.mean(cells == 1) > 0.2  # holes are really there
    grid = env.render_chunk(row(first.observation, 0))
    rows = grid.split("\n")
    assert len(rows) == env.size and all(len(line) == env.size for line in rows)
    assert grid.count("P") == 1 and grid.count("G") == 1
    assert bool(jnp.all(final.success))
    np.testing.assert_array_equal(np.asarray(final.turn), distances)


def test_frozen_lake_moves_words_letters_walls_and_holes(runners):
    r = runners["frozen_lake"]
    env = r.env
    cells = np.zeros(16, np.int32)
    cells[1], cells[15] = 1, 2  # hole right of the start, goal in the corner
    state = r.one_state().replace(cells=jnp.asarray(cells), position=jnp.asarray(0))
    moves = [("Left", 0), ("Up<eot>", 0), ("Down", 4), ("D", 4), ("down", 4)]
    garbage = ["", "Lef", "left!", "x", "UpUp"]
    results = r.step_cases(state, [m[0] for m in moves] + garbage + ["R"])
    for (action, position), (new_state, ts) in zip(moves, results):
        assert int(new_state.position) == position and not bool(ts.info["format_error"])
    for action, (new_state, ts) in zip(garbage, results[len(moves):]):
        assert bool(ts.info["format_error"]) and int(new_state.position) == 0, action
        assert env.render_chunk(ts.observation).startswith("invalid\nPO__")
        assert float(ts.reward) == pytest.approx(-0.1)
    _, ts = results[-1]
    assert bool(ts.terminated) and not bool(ts.info["success"]) and float(ts.reward) == 0.0
    assert env.render_chunk(ts.observation).startswith("_X__")
    (_, ts), = r.step_cases(state.replace(position=jnp.asarray(11)), ["D"])
    assert bool(ts.info["success"]) and float(ts.reward) == 1.0
    assert env.render_chunk(ts.observation).endswith("___*")


def test_frozen_lake_slippery_moves_sideways(runners):
    r = runners["frozen_lake"]
    params = r.env.default_params(hole_prob=0.0, slip_prob=1.0)
    state = r.one_state().replace(cells=jnp.zeros(16, jnp.int32).at[15].set(2),
                                  position=jnp.asarray(5))
    results = r.step_cases(state, ["Down"] * BATCH, params=params)
    positions = np.array([int(s.position) for s, _ in results])
    assert set(positions.tolist()) == {4, 6}  # only left or right of 5, never down (9)
    assert 0.4 < np.mean(positions == 4) < 0.6


def test_bandit_oracle_optimum_and_payoffs(runners):
    r = runners["bandit"]
    env, params = r.env, r.params
    rewards = []
    for seed in range(16):
        first, steps, state = r.rollout(jax.random.key(31 + seed))
        assert bool(jnp.all(state.success)) and bool(jnp.all(state.terminated))
        rewards.append(np.asarray(steps[0].reward))
    rewards = np.concatenate(rewards)
    # dragon: EV 0.25 > phoenix 0.15; rewards are 0 or 1 with mean ~ 0.25.
    assert set(np.unique(rewards).tolist()) <= {0.0, 1.0}
    assert abs(rewards.mean() - 0.25) < 4 * math.sqrt(0.25 * 0.75 / rewards.size)
    replies = {env.render_chunk(row(steps[0].observation, i)) for i in range(50)}
    assert replies == {"0.00", "1.00"}
    prompts = {env.render_chunk(row(first.observation, i)) for i in range(50)}
    assert prompts == {"arms: phoenix dragon", "arms: dragon phoenix"}
    # With a richer sure arm the optimum flips to phoenix.
    rich = params.replace(low_payoff=jnp.asarray(0.5, jnp.float32))
    state0 = r.one_state(rich)
    action = r.oracle(jax.random.split(jax.random.key(0), BATCH),
                      jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH,) + x.shape), state0),
                      rich)
    assert env.render_chunk(row(action, 0)) == "phoenix<eot>"
    (_, ts), (_, bad) = r.step_cases(state0, ["phoenix<eot>", "tiger"], params=rich)
    assert env.render_chunk(ts.observation) == "0.50" and float(ts.reward) == 0.5
    assert env.render_chunk(bad.observation) == "invalid"
    assert float(bad.reward) == pytest.approx(-0.1)


def test_render_trajectory(runners):
    r = runners["calculator"]
    keys = jax.random.split(jax.random.key(0), BATCH)
    state, first = r.reset(keys, r.params)
    action = r.oracle(keys, state, r.params)
    _, ts = r.step(keys, state, action, r.params)
    # Row 0 as a one-turn trajectory with a leading turn axis.
    actions = TokenChunk(action.tokens[:1], action.length[:1])
    observations = TokenChunk(ts.observation.tokens[:1], ts.observation.length[:1])
    lines = r.env.render(row(first.observation, 0), actions, observations,
                         rewards=np.zeros(1)).split("\n")
    left, op, right = int(state.left[0]), "+-*"[int(state.operator[0])], int(state.right[0])
    assert lines == [f"[env] {left}{op}{right}", f"[agent] <calc>{left}{op}{right}</calc><eot>",
                     f"[env] {int(state.answer[0])}  (reward +0.000)"]


def test_bad_construction_and_registry():
    with pytest.raises(ValueError, match="unknown env name 'nope'.*guess_number"):
        E.make("nope")
    with pytest.raises(ValueError, match="size must be an int in \\[2, 12\\]"):
        E.make("frozen_lake", size=1)
    with pytest.raises(ValueError, match="max_digits"):
        E.make("calculator", max_digits=0)
    with pytest.raises(ValueError, match="num_pulls"):
        E.make("bandit", num_pulls=0)
    with pytest.raises(ValueError, match="hole_prob"):
        E.FrozenLake().default_params(hole_prob=1.0)
    # arl's own registrations (tests may register their own envs, e.g. tests/user_envs.py).
    own = [n for n in E.registered_names() if E.registry.factory(n).__module__.startswith("arl.")]
    assert own == sorted(NAMES + ["code_interpreter", "countdown", "sokoban", "sql"])

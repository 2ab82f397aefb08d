"""Stateful host environments (`arl.envs.sessions`): a session per episode opened at
reset with the episode's identity, stepped, and closed when the episode ends or fails;
a bounded pool with per-row errors; Monte Carlo branching replayed from recorded actions
(deterministic mode) or refused in one line (restart mode)."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

import arl
from arl import rollout as rollout_lib
from arl.envs import sessions
from arl.envs.base import TokenChunk
from arl.errors import ConfigError
from arl.rollout import branching
from tests.session_envs import DigitGame, DigitGames


def _play(env, seed=0, num_tasks=4, group_size=2, source="oracle"):
    traj = rollout_lib.scripted_rollout(env, jax.random.key(seed), num_tasks=num_tasks,
                                        group_size=group_size, action_source=source)
    return jax.device_get(traj)


def _digit(key):
    return DigitGame(key.seed).digit


def test_a_session_per_episode_opened_stepped_and_closed():
    env = DigitGames()
    traj = _play(env)
    opened = [entry[1] for entry in env.log if entry[0] == "open"]
    assert len(opened) == 8 and len({k.session_id for k in opened}) == 8
    # The rows of a group share their task seed (one reset key), not their session.
    seeds = collections.Counter(k.seed for k in opened)
    assert sorted(seeds.values()) == [2, 2, 2, 2]
    assert bool(traj.success.all()) and np.asarray(traj.num_turns).tolist() == [1] * 8
    closed = [entry[1] for entry in env.log if entry[0] == "close"]
    assert sorted(closed) == sorted(k.session_id for k in opened)
    assert env.live_sessions() == 0 and env.session_counts == {
        "opened": 8, "closed": 8, "evicted": 0, "replayed": 0}
    assert env.resume_mode == "replay" and env.has_oracle


def test_truncated_episodes_close_their_sessions_and_the_game_keeps_its_state():
    """Guessing "x" (a format error) every turn: the game counts the tries in its own
    state; after max_turns the episode is truncated and its session closed."""
    env = DigitGames(max_turns=3)
    keys = jax.random.split(jax.random.key(1), 3)
    params = arl.envs.broadcast_params(env.default_params(), 3)
    state, _ = jax.vmap(env.reset)(keys, params)
    ids = np.full((3, env.action_len), env.codec.pad_id, np.int32)
    ids[:, 0] = env.codec.encode("x")[0]
    chunk = TokenChunk(ids, np.ones((3,), np.int32))
    replies = []
    for _ in range(3):
        state, ts = jax.vmap(env.step)(keys, state, chunk, params)
        replies.append([env.codec.decode(np.asarray(ts.observation.tokens[b])[
            :int(ts.observation.length[b])], stop_at_pad=False) for b in range(3)])
    assert [r[0] for r in replies] == [f"one digit (try {t})" for t in (1, 2, 3)]
    assert all(len(set(r)) == 1 for r in replies)
    assert bool(np.asarray(ts.truncated).all()) and env.live_sessions() == 0
    assert env.session_counts["closed"] == 3


def test_per_row_errors_end_only_their_rows():
    probe = DigitGames()
    _play(probe, seed=2, num_tasks=8, group_size=1)
    digits = [_digit(e[1]) for e in probe.log if e[0] == "open"]
    bad_open, bad_step = digits[0], next(d for d in digits if d != digits[0])
    env = DigitGames(fail_open_on=(bad_open,), fail_step_on=(bad_step,))
    traj = _play(env, seed=2, num_tasks=8, group_size=1)
    success = np.asarray(traj.success)
    expected = np.array([d not in (bad_open, bad_step) for d in digits])
    np.testing.assert_array_equal(success, expected)
    assert 0 < expected.sum() < 8
    assert env.host_stats.host_errors >= int((~expected).sum())
    assert env.live_sessions() == 0  # the crashed sessions were closed too


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_bounded_pool_evicts_and_replays_or_fails_the_row(deterministic):
    """max_sessions=3 for 8 rows: the first 5 sessions are evicted at reset.
    Deterministic: an evicted row gets a fresh session replayed to its turn and plays on
    (all succeed; the replays evict others in turn); restart mode: the evicted rows end
    with "host error", the 3 in the pool play on."""
    env = DigitGames(max_sessions=3, deterministic=deterministic)
    traj = _play(env, seed=3)
    assert env.session_counts["evicted"] >= 5
    if deterministic:
        assert bool(traj.success.all()) and env.session_counts["replayed"] >= 5
    else:
        np.testing.assert_array_equal(traj.success, [False] * 5 + [True] * 3)
        np.testing.assert_array_equal(traj.num_turns, [1] * 8)
        assert env.session_counts["replayed"] == 0
    assert env.live_sessions() == 0


def test_branching_replays_the_recorded_actions_in_deterministic_mode():
    """The demonstrator guesses wrong once, then right. Continuations forked before turn
    1 get fresh sessions of their row's seed with the wrong guess replayed (the game
    counts it: the oracle's guess is its second try) and all succeed."""
    env = DigitGames(max_turns=3)
    traj = jax.jit(lambda k: rollout_lib.rollout(
        env, k, num_tasks=8, group_size=1, action_source="demonstrator",
        record_turn_states=True))(jax.random.key(8))
    assert bool(traj.success.all()) and np.asarray(traj.num_turns).tolist() == [2] * 8
    main_ids = {e[1].session_id for e in env.log if e[0] == "open"}
    values = jax.jit(lambda k: branching.branch_values(
        env, k, traj, branch_turns=(1,), num_samples=2, action_source="oracle",
        estimate="soft"))(jax.random.key(9))
    np.testing.assert_array_equal(values.values[:, 1], np.ones(8, np.float32))
    np.testing.assert_array_equal(values.success[:, 1], np.ones(8, np.float32))
    # Every continuation replayed its row's first (wrong) guess into a fresh session.
    replays = collections.defaultdict(list)
    for entry in env.log:
        if entry[0] == "step" and entry[1] not in main_ids:
            replays[entry[1]].append(entry[2])
    assert len(replays) >= 16 and env.session_counts["replayed"] >= 16
    games = {e[1].session_id: DigitGame(e[1].seed).digit for e in env.log if e[0] == "open"}
    for session_id, actions in replays.items():
        assert actions[0] == str((games[session_id] + 1) % 10), actions
    assert env.live_sessions() == 0


def test_restart_mode_refuses_branching_in_one_line():
    sessions.check_branching(DigitGames(deterministic=True), (1,))
    sessions.check_branching(DigitGames(deterministic=False), ())
    message = (r"^config.process.mc_samples=2 is invalid: Monte Carlo branching forks "
               r"mid-episode states \(before turns \(1, 2\)\), and env 'digit_game' holds "
               r"a session per episode and is not deterministic")
    with pytest.raises(ConfigError, match=message):
        sessions.check_branching(DigitGames(deterministic=False), (1, 2), 2)
    # Through the trainer a config builds: refused before anything is traced.
    from tests import session_env_config

    config = session_env_config.get_config()
    config.imports = ()
    config.env.kwargs.deterministic = False
    config.process.mc_samples = 2
    with pytest.raises(ConfigError, match=message):
        arl.build(config)

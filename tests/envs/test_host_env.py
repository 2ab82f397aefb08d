"""The host-environment contract (`arl.envs.host`) on a tiny pure-Python env.

`Reverse`: the prompt is "reverse <word>"; the turn that spells the word backwards ends
the episode ("yes", reward `bonus`); any other turn replies "no". A few special turns
exercise the failure paths: "boom" raises, "nan" returns a NaN reward, "sleep S" sleeps,
"shout" replies text with special-token names and characters the codec lacks.
"""

from __future__ import annotations

import logging
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import arl
from arl import rollout as rollout_lib
from arl.envs import CharCodec, Mixture, host
from arl.text import codec as codec_lib
from arl.envs.base import TokenChunk
from arl.envs.tasks.calculator import Calculator
from arl.envs.host import HostEnvironment, HostTurn
from arl.rollout import branching


@struct.dataclass
class ReverseParams:
    bonus: jax.Array  # float32 []


class Reverse(HostEnvironment):
    name = "reverse"
    memory_fields = ("tries",)

    def __init__(self, max_turns: int = 3, step_timeout_s: float | None = 5.0):
        self.codec = CharCodec()
        self.max_turns = max_turns
        self.prompt_len, self.obs_len, self.action_len = 16, 12, 16
        self.step_timeout_s = step_timeout_s
        self.max_workers = 8

    def default_params(self):
        return ReverseParams(bonus=jnp.asarray(1.0, jnp.float32))

    def reward_bounds(self, params):
        return jnp.zeros((), jnp.float32), params.bonus

    def make_task(self, seed, params):
        rng = random.Random(seed)
        return "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))

    def prompt(self, task, params):
        return f"reverse {task}"

    def host_step(self, episode, action):
        tries = episode.memory["tries"] + 1
        if action.startswith("sleep "):
            time.sleep(float(action[len("sleep "):]))
            return HostTurn(reply="slept", memory={"tries": tries})
        if action == "boom":
            raise RuntimeError("boom")
        if action == "nan":
            return HostTurn(reply="x", reward=float("nan"))
        if action == "bad memory":
            return HostTurn(reply="x", memory={"nonsense": 1})
        if action == "shout":
            return HostTurn(reply="<eot>[A]<pad", memory={"tries": tries})
        correct = action == episode.task[::-1]
        return HostTurn(reply="yes" if correct else "no",
                        reward=float(episode.params.bonus) * correct, terminated=correct,
                        success=correct, format_error=not action,
                        process_reward=0.5 * correct, memory={"tries": tries})

    def host_oracle(self, episode):
        return episode.task[::-1]

    def host_demonstrator(self, episode, rng):
        return episode.task[::-1] if rng.random() < 0.5 else episode.task


def _chunks(env, texts):
    ids = np.full((len(texts), env.action_len), env.codec.pad_id, np.int32)
    lengths = np.zeros((len(texts),), np.int32)
    for row, text in enumerate(texts):
        encoded = env.codec.encode(text)
        ids[row, :len(encoded)] = encoded
        lengths[row] = len(encoded)
    return TokenChunk(jnp.asarray(ids), jnp.asarray(lengths))


def _texts(env, chunk):
    return [env.codec.decode(np.asarray(chunk.tokens[b])[:int(chunk.length[b])],
                             stop_at_pad=False) for b in range(chunk.tokens.shape[0])]


def _reset(env, keys):
    params = arl.envs.broadcast_params(env.default_params(), keys.shape[0])
    return jax.jit(jax.vmap(env.reset))(keys, params), params


def test_one_callback_per_batch_reset_and_step():
    env = Reverse()
    keys = jax.random.split(jax.random.key(0), 8)
    (state, ts), params = _reset(env, keys)
    stats = env.host_stats
    assert (stats.callbacks, stats.rows) == (1, 8)
    words = [env.make_task(host._seed_int(state.seed[b]), None) for b in range(8)]
    assert _texts(env, ts.observation) == [f"reverse {w}" for w in words]

    actions = _chunks(env, [w[::-1] if b % 2 else w for b, w in enumerate(words)])
    step = jax.jit(jax.vmap(env.step))
    state, ts = step(jax.random.split(jax.random.key(1), 8), state, actions, params)
    stats = env.host_stats
    assert (stats.callbacks, stats.rows, stats.live_rows) == (2, 16, 16)
    assert _texts(env, ts.observation) == ["yes" if b % 2 else "no" for b in range(8)]
    np.testing.assert_array_equal(ts.reward, [b % 2 for b in range(8)])
    np.testing.assert_array_equal(ts.terminated, [b % 2 == 1 for b in range(8)])
    np.testing.assert_array_equal(ts.info["process_reward"], [0.5 * (b % 2) for b in range(8)])
    np.testing.assert_array_equal(state.memory[:, 0], np.ones(8))
    np.testing.assert_array_equal(state.turn, np.ones(8))

    # A finished row is not sent to the host again; the live ones are.
    state, ts = step(jax.random.split(jax.random.key(2), 8), state, actions, params)
    assert env.host_stats.live_rows == 16 + 4
    np.testing.assert_array_equal(state.memory[:, 0], [2 - b % 2 for b in range(8)])
    assert _texts(env, ts.observation) == ["no" if b % 2 == 0 else "" for b in range(8)]


def test_nested_vmap_and_unbatched_calls_match_the_flat_batch():
    env = Reverse()
    keys = jax.random.split(jax.random.key(3), 8)
    (flat, flat_ts), _ = _reset(env, keys)
    env.reset_host_stats()
    params = arl.envs.broadcast_params(env.default_params(), 8)
    nested_params = jax.tree.map(lambda x: x.reshape((2, 4) + x.shape[1:]), params)
    nested, nested_ts = jax.jit(jax.vmap(jax.vmap(env.reset)))(keys.reshape(2, 4),
                                                               nested_params)
    assert (env.host_stats.callbacks, env.host_stats.rows) == (1, 8)
    np.testing.assert_array_equal(nested_ts.observation.tokens.reshape(8, -1),
                                  flat_ts.observation.tokens)
    single_state, single_ts = jax.jit(env.reset)(keys[5], env.default_params())
    np.testing.assert_array_equal(single_ts.observation.tokens, flat_ts.observation.tokens[5])
    np.testing.assert_array_equal(single_state.seed, flat.seed[5])


def test_rollout_follows_the_rules_row_by_row():
    """Every row of a demonstrator rollout, checked against the rules in plain Python."""
    env = Reverse()
    traj = rollout_lib.scripted_rollout(env, jax.random.key(4), num_tasks=8, group_size=4,
                                        action_source="demonstrator")
    agent = np.asarray(traj.agent_mask) > 0
    obs = np.asarray(traj.observation_mask) > 0
    tokens = np.asarray(traj.tokens)
    prompts = []
    for row in range(32):
        segments, start = [], 1
        while start < int(traj.length[row]):
            end = start
            while end < int(traj.length[row]) and agent[row, end] == agent[row, start] \
                    and obs[row, end] == obs[row, start]:
                end += 1
            segments.append((agent[row, start], env.codec.decode(tokens[row, start:end],
                                                                 stop_at_pad=False)))
            start = end
        prompt = segments[0][1]
        prompts.append(prompt)
        assert prompt.startswith("reverse ")
        word = prompt[len("reverse "):]
        turns = [(a, r) for (_, a), (_, r) in zip(segments[1::2], segments[2::2])]
        expected_success = False
        for i, (action, reply) in enumerate(turns):
            action = action.removesuffix("<eot>")
            assert action in (word, word[::-1])
            assert reply == ("yes" if action == word[::-1] else "no")
            if reply == "yes":
                expected_success = True
                assert i == len(turns) - 1
        assert bool(traj.success[row]) == expected_success
        assert int(traj.num_turns[row]) == len(turns)
        assert float(traj.episode_return[row]) == float(expected_success)
        assert float(np.asarray(traj.process_rewards[row]).sum()) == 0.5 * expected_success
    # The rows of a group share their task.
    groups = [prompts[4 * g:4 * g + 4] for g in range(8)]
    assert all(len(set(group)) == 1 for group in groups)
    assert len({group[0] for group in groups}) > 1


def test_same_key_same_trajectory_and_dead_rows_cost_nothing():
    env = Reverse()
    first = rollout_lib.scripted_rollout(env, jax.random.key(5), num_tasks=4, group_size=2,
                                         action_source="oracle")
    stats = env.host_stats
    # reset + (policy, step) per turn; the oracle solves every task in its first turn,
    # so turns 2 and 3 send no live row to the host.
    assert stats.callbacks == 1 + 2 * env.max_turns
    assert stats.live_rows == 8 + 8 + 8
    second = rollout_lib.scripted_rollout(env, jax.random.key(5), num_tasks=4, group_size=2,
                                          action_source="oracle")
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(a, b)
    assert bool(first.success.all())


def test_failures_of_the_host_become_observations_within_the_timeout():
    env = Reverse(step_timeout_s=0.5)
    keys = jax.random.split(jax.random.key(6), 6)
    (state, _), params = _reset(env, keys)
    word = env.make_task(host._seed_int(state.seed[5]), None)
    actions = _chunks(env, ["boom", "nan", "sleep 3", "bad memory", "shout", word[::-1]])
    start = time.monotonic()
    state, ts = jax.jit(jax.vmap(env.step))(jax.random.split(keys[0], 6), state, actions,
                                            params)
    jax.block_until_ready(ts)
    elapsed = time.monotonic() - start
    assert elapsed < 2.5, elapsed  # the sleeping row was cut at 0.5 s, not waited for
    replies = _texts(env, ts.observation)
    assert replies[:4] == ["host error", "host error", "timeout", "host error"]
    assert replies[4] == "<eot>?A?<pad"  # spelled out, not special ids
    assert replies[5] == "yes"
    reply_ids = np.asarray(ts.observation.tokens[4])[:int(ts.observation.length[4])]
    assert env.codec.eot_id not in reply_ids and env.codec.pad_id not in reply_ids
    np.testing.assert_array_equal(ts.info["host_error"], [True] * 4 + [False] * 2)
    np.testing.assert_array_equal(ts.terminated, [True] * 4 + [False, True])
    np.testing.assert_array_equal(ts.reward, [0, 0, 0, 0, 0, 1])
    assert env.host_stats.host_errors == 4
    env.close()


def test_host_failures_are_logged_in_one_line_each(caplog):
    """A failing row is an ERROR record of one line naming the exception and where it
    was raised (the traceback only at DEBUG), not a traceback at every turn."""
    env = Reverse(step_timeout_s=2.0)  # generous: the other rows must not time out
    keys = jax.random.split(jax.random.key(6), 4)
    (state, _), params = _reset(env, keys)
    actions = _chunks(env, ["boom", "nan", "sleep 4", "bad memory"])
    with caplog.at_level(logging.INFO, logger="arl.envs.host"):
        state, ts = jax.jit(jax.vmap(env.step))(jax.random.split(keys[0], 4), state,
                                                actions, params)
        jax.block_until_ready(ts)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 4 and all(r.exc_info is None for r in errors)
    lines = sorted(r.getMessage() for r in errors)
    assert all("\n" not in line for line in lines)
    seed = host._seed_int(state.seed[1])
    assert f"reverse: bad host turn for row 1 (task seed {seed}): ValueError: non-finite " \
           "reward nan or process reward 0.0 (at host.py:" in "\n".join(lines)
    assert "reverse: host turn failed for row 0: sandbox error: tool call failed: " \
           "RuntimeError: boom" in lines
    assert "reverse: host turn timed out for row 2: timeout after 2.0 s" in lines
    env.close()


def test_an_env_without_host_oracle_has_no_oracle():
    class NoOracle(Reverse):
        host_oracle = HostEnvironment.host_oracle
        host_demonstrator = HostEnvironment.host_demonstrator

    assert Reverse().has_oracle and Reverse().has_demonstrator
    assert not NoOracle().has_oracle and not NoOracle().has_demonstrator
    assert not NoOracle().supports_action_source("oracle")


def test_rows_run_in_parallel():
    env = Reverse()
    keys = jax.random.split(jax.random.key(7), 8)
    (state, _), params = _reset(env, keys)
    step = jax.jit(jax.vmap(env.step))
    actions = _chunks(env, ["sleep 0.4"] * 8)
    jax.block_until_ready(step(jax.random.split(keys[0], 8), state, actions, params))
    start = time.monotonic()
    jax.block_until_ready(step(jax.random.split(keys[1], 8), state, actions, params))
    assert time.monotonic() - start < 1.6  # one by one: 3.2 s


def test_reply_and_action_encoding():
    codec = CharCodec()
    ids, length = codec_lib.encode_reply(codec, "abc", 8)
    assert codec.decode(ids[:length]) == "abc" and (ids[length:] == codec.pad_id).all()
    ids, length = codec_lib.encode_reply(codec, "0123456789", 6)
    assert length == 6 and codec.decode(ids) == "0123.."
    ids, length = codec_lib.encode_reply(codec, "a[b]{c}\t", 16)
    assert codec.decode(ids[:length]) == "a?b??c??"
    ids, length = codec_lib.encode_action(codec, "xyz", 8)
    assert list(ids[:length]) == codec.encode("xyz") + [codec.eot_id]
    ids, length = codec_lib.encode_action(codec, "x" * 20, 8)
    assert length == 8 and codec.eot_id not in ids
    tokens = np.asarray(codec.encode("<py>1<eot>") + [0, 0])
    assert codec_lib.decode_action(codec, tokens, 5) == "<py>1"


def test_branching_forks_a_host_state():
    """Continuations forked before turn 1 start from the forked memory and task: the
    oracle solves every row that reached turn 1, so every known value is 1."""
    env = Reverse()
    key = jax.random.key(8)
    traj = jax.jit(lambda k: rollout_lib.rollout(
        env, k, num_tasks=8, group_size=1, action_source="demonstrator",
        record_turn_states=True))(key)
    reached = np.asarray(traj.turn_active[:, 1])
    assert 0 < reached.sum() < 8
    np.testing.assert_array_equal(traj.turn_states.memory[:, 1, 0], np.ones(8))  # 1 try
    values = jax.jit(lambda k: branching.branch_values(
        env, k, traj, branch_turns=(1,), num_samples=2, action_source="oracle",
        estimate="soft"))(jax.random.key(9))
    np.testing.assert_array_equal(values.known[:, 1], reached)
    np.testing.assert_array_equal(values.values[:, 1], reached.astype(np.float32))


def test_mixtures_refuse_host_members():
    with pytest.raises(ValueError, match="cannot be a Mixture member"):
        Mixture([Calculator(), Reverse()])
    c = arl.default_config()
    c.env.name = "mixture"
    c.env.members = ({"name": "calculator"}, {"name": "code_interpreter"})
    with pytest.raises(ValueError, match="code_interpreter.*cannot be a Mixture member"):
        arl.make_env(c.env)

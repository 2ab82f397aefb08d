"""Episode success is the environment's success at the END of the episode (a state, which
a later turn can undo), in rollouts and in Monte Carlo continuations forked mid-episode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl import envs, rollout
from arl.text import chunks
from arl.envs.base import TokenEnvironment, TokenEnvState
from arl.rollout import branching


@struct.dataclass
class SwitchParams:
    pattern: jax.Array  # int32 [max_turns]: the oracle writes "1" on turn t iff pattern[t]


class Switch(TokenEnvironment):
    """A light switch: "1" turns success on, "0" turns it off; the episode runs max_turns
    turns and reward is 0. Success after the episode is the LAST switch position."""

    name = "switch"

    def __init__(self, max_turns: int = 3):
        self.codec = envs.CharCodec()
        self.max_turns = max_turns
        self.prompt_len, self.obs_len, self.action_len = 2, 2, 2

    def default_params(self):
        return SwitchParams(pattern=jnp.asarray([1, 0, 1, 0][:self.max_turns], jnp.int32))

    def _reset(self, key, params):
        false = jnp.zeros((), bool)
        return (TokenEnvState(turn=jnp.zeros((), jnp.int32), terminated=false,
                              truncated=false, success=false),
                chunks.constant_chunk(self.codec, "go", self.prompt_len))

    def _transition(self, key, state, content, params):
        digit_ids = jnp.asarray(self.codec.digit_ids)
        on = (content.length == 1) & (content.tokens[0] == digit_ids[1])
        off = (content.length == 1) & (content.tokens[0] == digit_ids[0])
        success = jnp.where(on, True, jnp.where(off, False, state.success))
        reply = chunks.constant_chunk(self.codec, "ok", self.obs_len)
        return state.replace(success=success), reply, jnp.zeros((), jnp.float32), ~(on | off)

    def oracle_action(self, key, state, params):
        return chunks.select_text(self.codec, params.pattern[state.turn], ["0<eot>", "1<eot>"],
                                  self.action_len)

    def reward_bounds(self, params):
        return jnp.asarray(0.0), jnp.asarray(0.0)


def _play(max_turns, pattern, *, record_turn_states=False):
    env = Switch(max_turns)
    params = envs.broadcast_params(SwitchParams(pattern=jnp.asarray(pattern, jnp.int32)), 4)
    traj = jax.jit(lambda key: rollout.rollout(
        env, key, num_tasks=2, group_size=2, action_source="oracle", env_params=params,
        record_turn_states=record_turn_states))(jax.random.key(0))
    return env, params, traj


def test_success_is_the_state_at_the_end_of_the_episode():
    _, _, on_off = _play(2, [1, 0])  # on, then off: the episode ends unsuccessful
    np.testing.assert_array_equal(np.asarray(on_off.success), False)
    np.testing.assert_array_equal(np.asarray(on_off.turn_success), [[True, False]] * 4)
    _, _, off_on = _play(2, [0, 1])
    np.testing.assert_array_equal(np.asarray(off_on.success), True)
    _, _, on_off_on = _play(3, [1, 0, 1])
    np.testing.assert_array_equal(np.asarray(on_off_on.success), True)


def test_success_stays_when_the_horizon_stops_the_episode():
    env = Switch(3)
    params = envs.broadcast_params(SwitchParams(pattern=jnp.asarray([1, 0, 0], jnp.int32)), 2)
    traj = rollout.rollout(env, jax.random.key(0), num_tasks=2, group_size=1,
                           action_source="oracle", env_params=params, horizon=1)
    np.testing.assert_array_equal(np.asarray(traj.success), True)  # after turn 0 only
    np.testing.assert_array_equal(np.asarray(traj.num_turns), 1)


def test_forked_continuations_start_with_the_success_of_their_state():
    """A continuation forked before turn 1 starts where the episode was after turn 0
    (success on); one forked before turn 0 starts with success off."""
    env, params, traj = _play(3, [1, 0, 1], record_turn_states=True)
    # A horizon of 0 stops every continuation before it plays: its success is the fork's.
    carry, _, _ = branching.play_continuations(
        env, jax.random.key(1), traj, branch_turns=(0, 1, 2), num_samples=1,
        action_source="oracle", env_params=params, horizon=0)
    success = np.asarray(carry.success).reshape(4, 3)
    np.testing.assert_array_equal(success, [[False, True, False]] * 4)
    # Played to the end, every continuation replays the pattern: on at the end.
    carry, _, _ = branching.play_continuations(
        env, jax.random.key(1), traj, branch_turns=(1, 2), num_samples=2,
        action_source="oracle", env_params=params)
    np.testing.assert_array_equal(np.asarray(carry.success), True)


def test_bandit_success_matches_the_final_state():
    """The three-pull bandit (success: the LAST valid pull chose the better arm) with its
    demonstrator: the trajectory's success rate is the rate of a correct last pull, not of
    any correct pull (which was ~0.87 against ~0.51 before)."""
    env = envs.make("bandit", num_pulls=3)
    traj = rollout.scripted_rollout(env, jax.random.key(3), num_tasks=512, group_size=1,
                                    action_source="demonstrator")
    last = np.asarray(traj.num_turns) - 1
    at_end = np.asarray(traj.turn_success)[np.arange(512), last]
    np.testing.assert_array_equal(np.asarray(traj.success), at_end)
    any_turn = np.asarray(traj.turn_success).any(axis=1)
    assert np.asarray(traj.success).mean() < any_turn.mean() - 0.2

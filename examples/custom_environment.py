"""A token environment of your own: prompt "say 7", answering "7" succeeds.

A `TokenEnvironment` subclass with `flax.struct` state and params, jittable throughout:
`_reset` draws the task from the key, `_transition` handles one turn (a wrong answer is a
format error, never an exception), `oracle_action` is the scripted policy. After
`envs.register` the name works in configs and mixtures (docs/environments.md, "Writing an
environment").

    python examples/custom_environment.py
"""

import jax
import jax.numpy as jnp
from flax import struct

from arl import envs, rollout
from arl.text import chunks, parsing
from arl.envs.base import TokenEnvironment, TokenEnvState


@struct.dataclass
class ParrotParams:
    format_penalty: jax.Array  # float32 []


@struct.dataclass
class ParrotState(TokenEnvState):
    digit: jax.Array  # int32 []: the task, drawn in reset from the key


class Parrot(TokenEnvironment):
    """Prompt "say 7": answering "7" succeeds (reward 1); anything else is a format error."""

    name = "parrot"

    def __init__(self, codec=None, max_turns: int = 2):
        self.codec = codec or envs.CharCodec()
        self.max_turns = max_turns
        self.prompt_len, self.obs_len, self.action_len = len("say 7"), len("wrong"), 2

    def default_params(self):
        return ParrotParams(format_penalty=jnp.asarray(0.1, jnp.float32))

    def _reset(self, key, params):
        digit = jax.random.randint(key, (), 0, 10)
        false = jnp.zeros((), bool)
        state = ParrotState(turn=jnp.zeros((), jnp.int32), terminated=false,
                            truncated=false, success=false, digit=digit)
        texts = [f"say {d}" for d in range(10)]
        return state, chunks.select_text(self.codec, digit, texts, self.prompt_len)

    def _transition(self, key, state, content, params):
        digit_ids = jnp.asarray(self.codec.digit_ids)
        correct = (content.length == 1) & (content.tokens[0] == digit_ids[state.digit])
        state = state.replace(terminated=correct, success=correct)
        reply = chunks.select_text(self.codec, correct.astype(jnp.int32),
                                   ["wrong", "yes"], self.obs_len)
        reward = jnp.where(correct, 1.0, -params.format_penalty)
        return state, reply, reward, ~correct

    def oracle_action(self, key, state, params):
        texts = [f"{d}<eot>" for d in range(10)]
        return chunks.select_text(self.codec, state.digit, texts, self.action_len)

    def reward_bounds(self, params):
        return -params.format_penalty, jnp.asarray(1.0)


envs.register("parrot", Parrot)  # now config.env.name = "parrot" works everywhere
env = envs.make("parrot")
traj = rollout.scripted_rollout(env, jax.random.key(0), num_tasks=4, group_size=2,
                                action_source="oracle")
print(rollout.render_trajectory(env, traj, row=0))
assert bool(traj.success.all())

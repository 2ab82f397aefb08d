"""An environment defined outside `arl`, registered when this module is imported.

`config.imports = ("tests.user_envs",)` (tests/user_env_config.py) makes its name valid
in configs; tests/test_cli.py trains, resumes and evaluates it through the command-line
programs. It defines an oracle but no demonstrator, so a config asking for demonstrator
demonstrations is refused before anything is compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from arl import envs
from arl.text import chunks
from arl.envs.base import NON_NEGATIVE, TokenEnvironment, TokenEnvState


@struct.dataclass
class SayDigitParams:
    format_penalty: jax.Array  # float32 []


@struct.dataclass
class SayDigitState(TokenEnvState):
    digit: jax.Array  # int32 []: the task, drawn in reset from the key


class SayDigit(TokenEnvironment):
    """Prompt "say 7": answering "7" succeeds (reward 1); anything else is a format error
    (reward -format_penalty) and the episode goes on, up to `max_turns`."""

    name = "say_digit"

    def __init__(self, codec=None, max_turns: int = 2):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.codec = codec or envs.CharCodec()
        self.max_turns = max_turns
        self.prompt_len, self.obs_len, self.action_len = len("say 7"), len("wrong"), 2

    def default_params(self):
        return SayDigitParams(format_penalty=jnp.asarray(0.1, jnp.float32))

    def param_ranges(self):
        return {"format_penalty": NON_NEGATIVE}

    def _reset(self, key, params):
        digit = jax.random.randint(key, (), 0, 10)
        false = jnp.zeros((), bool)
        state = SayDigitState(turn=jnp.zeros((), jnp.int32), terminated=false,
                              truncated=false, success=false, digit=digit)
        return state, chunks.select_text(self.codec, digit, [f"say {d}" for d in range(10)],
                                         self.prompt_len)

    def _transition(self, key, state, content, params):
        digit_ids = jnp.asarray(self.codec.digit_ids)
        correct = (content.length == 1) & (content.tokens[0] == digit_ids[state.digit])
        state = state.replace(terminated=correct, success=correct)
        reply = chunks.select_text(self.codec, correct.astype(jnp.int32), ["wrong", "yes"],
                                   self.obs_len)
        return state, reply, jnp.where(correct, 1.0, -params.format_penalty), ~correct

    def oracle_action(self, key, state, params):
        return chunks.select_text(self.codec, state.digit, [f"{d}<eot>" for d in range(10)],
                                  self.action_len)

    def reward_bounds(self, params):
        return -params.format_penalty, jnp.asarray(1.0)


envs.register("say_digit", SayDigit)

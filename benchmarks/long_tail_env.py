"""`long_tail`: a token env whose episode lengths follow a heavy tail, for measuring how a
rollout copes with a few episodes far longer than the median (benchmarks/
continuous_batching.py, the slot scheduler's tests).

Each reset draws the episode's number of turns from a discrete Pareto tail,
`ceil(median_turns * u ** (-1 / alpha) / 2 ** (1 / alpha))` with u ~ U(0, 1], capped at
`max_turns`: the median is `median_turns` and, with the default alpha = log 50 / log 10,
the 99th percentile is 10 times the median. A turn is any text; the reply is "ok" until
the last turn, which pays 1 when the agent's turn starts with a digit ("success"), else 0.
Importing the module registers the env (config: `imports = ("benchmarks.long_tail_env",)`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from arl import envs
from arl.envs.base import TokenChunk, TokenEnvironment, TokenEnvState
from arl.text import chunks
from arl.text.codec import CharCodec, Codec

TEN_TO_ONE = math.log(50) / math.log(10)  # p99 : median = 10 for a Pareto tail


@struct.dataclass
class LongTailParams:
    median_turns: jax.Array  # float32: the median number of turns of an episode


@struct.dataclass
class LongTailState(TokenEnvState):
    target_turns: jax.Array  # int32: the turns this episode lasts


class LongTail(TokenEnvironment):
    """Episodes of a heavy-tailed number of turns; `max_turns` caps the tail."""

    name = "long_tail"

    def __init__(self, codec: Codec | None = None, max_turns: int = 20, action_len: int = 8,
                 alpha: float = TEN_TO_ONE):
        if max_turns < 1 or action_len < 1 or alpha <= 0:
            raise ValueError(f"long_tail: max_turns={max_turns} and action_len={action_len} "
                             f"must be >= 1, alpha={alpha} > 0")
        self.codec = codec or CharCodec()
        self.max_turns, self.action_len, self.alpha = max_turns, action_len, alpha
        self.prompt_len, self.obs_len = 2, 2

    def default_params(self) -> LongTailParams:
        return LongTailParams(median_turns=jnp.asarray(2.0, jnp.float32))

    def reward_bounds(self, params):
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)

    def target_turns(self, key, params) -> jax.Array:
        """int32 []: the episode's number of turns, from the Pareto tail."""
        u = jax.random.uniform(key, minval=1e-6, maxval=1.0)
        turns = params.median_turns * (u ** (-1.0 / self.alpha)) / (2.0 ** (1.0 / self.alpha))
        return jnp.clip(jnp.ceil(turns), 1, self.max_turns).astype(jnp.int32)

    def _reset(self, key, params):
        false = jnp.zeros((), bool)
        state = LongTailState(turn=jnp.zeros((), jnp.int32), terminated=false,
                              truncated=false, success=false,
                              target_turns=self.target_turns(key, params))
        return state, chunks.constant_chunk(self.codec, "go", self.prompt_len)

    def _transition(self, key, state, content: TokenChunk, params):
        del key, params
        last = state.turn + 1 >= state.target_turns
        first = content.tokens[0]
        digit = (content.length > 0) & (jnp.asarray(self.codec.digit_value)[first] >= 0)
        success = last & digit
        new_state = state.replace(terminated=last, success=success)
        reply = chunks.constant_chunk(self.codec, "ok", self.obs_len)
        return new_state, reply, success.astype(jnp.float32), jnp.zeros((), bool)

    def oracle_action(self, key, state, params) -> TokenChunk:
        del key, state, params
        ids = chunks.with_eot(self.codec, "7")
        return chunks.pad_chunk(TokenChunk(tokens=jnp.asarray(ids, jnp.int32),
                                           length=jnp.asarray(len(ids), jnp.int32)),
                                self.action_len, self.codec.pad_id)


if "long_tail" not in envs.registered_names():
    envs.register("long_tail", LongTail)

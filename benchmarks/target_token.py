"""arl's environment of the equal-work settings without turns (`harness.arl_config`).

One turn: the prompt is `prompt_len` random token ids, the agent writes exactly
`gen_len` tokens (the end-of-turn id lies outside the sampled vocabulary), and the reward
is the share of them equal to the target id, as every peer computes it on its own
generated ids (`peer_workers/protocol.py`). Registered on import as
"peers_target_token".
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position

from arl import envs as envs_lib  # noqa: E402


class IdCodec(envs_lib.Codec):
    """Token ids as their own text ("t5 t17 ..."): the single-turn settings' vocabulary.
    The end-of-turn id is `vocab_size`, outside the sampled range, so a turn always runs
    its whole token budget."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.pad_id = protocol.PAD_ID
        self.bos_id = protocol.BOS_ID
        self.eot_id = self.vocab_size
        self.digit_ids = np.zeros((10,), np.int32)
        self.digit_value = np.full((self.vocab_size,), -1, np.int32)

    def encode(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids, stop_at_pad: bool = True, show_special: bool = True) -> str:
        return " ".join(f"t{int(i)}" for i in ids)


@struct.dataclass
class TargetTokenParams:
    target: jax.Array  # int32: the rewarded token id


class TargetToken(envs_lib.TokenEnvironment):
    """One turn: the prompt is `prompt_len` uniformly random ids in
    [FIRST_PROMPT_ID, vocab); the agent writes `gen_len` tokens; reward = the share of
    them equal to `params.target`. Registered as "peers_target_token"."""

    name = "peers_target_token"

    def __init__(self, vocab: int = 64, prompt_len: int = 7, gen_len: int = 16):
        self.codec = IdCodec(vocab)
        self.max_turns = 1
        self.prompt_len = int(prompt_len)
        self.obs_len = 0  # no reply after the single turn
        self.action_len = int(gen_len)

    def default_params(self) -> TargetTokenParams:
        return TargetTokenParams(target=jnp.asarray(protocol.TARGET_ID, jnp.int32))

    def reward_bounds(self, params):
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)

    def _reset(self, key, params):
        false = jnp.zeros((), bool)
        state = envs_lib.TokenEnvState(turn=jnp.zeros((), jnp.int32), terminated=false,
                                       truncated=false, success=false)
        tokens = jax.random.randint(key, (self.prompt_len,), protocol.FIRST_PROMPT_ID,
                                    self.codec.vocab_size, jnp.int32)
        return state, envs_lib.TokenChunk(tokens, jnp.asarray(self.prompt_len, jnp.int32))

    def _transition(self, key, state, content, params):
        del key
        valid = jnp.arange(content.tokens.shape[-1]) < content.length
        hits = jnp.sum((content.tokens == params.target) & valid)
        reward = hits / jnp.maximum(content.length, 1)
        state = state.replace(terminated=jnp.ones((), bool), success=reward > 0.5)
        return state, self.empty_observation(), reward.astype(jnp.float32), jnp.zeros((), bool)

    def oracle_action(self, key, state, params):
        return envs_lib.TokenChunk(jnp.full((self.action_len,), params.target, jnp.int32),
                                   jnp.asarray(self.action_len, jnp.int32))


envs_lib.register(TargetToken.name, TargetToken)

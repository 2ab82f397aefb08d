"""`bandit`: the RAGEN two-armed bandit with symbolic arm names.

Prompt: "arms: phoenix dragon" (the listing order is drawn per reset, so a policy must
read the names, not the position). A turn is one arm name then end-of-turn. The
low-risk arm (default "phoenix") pays `low_payoff` for sure; the high-risk arm (default
"dragon") pays `high_payoff` with probability `high_prob`, else 0. The reply is the
payoff with two decimals ("0.15"), or "invalid". The episode terminates after
`num_pulls` valid pulls (default 1: a single-turn task).

info["success"]: the last valid pull chose the arm with the higher expected payoff.

Reward per step: payoff − turn_cost − format_penalty·[malformed], in
[min(0, low_payoff, high_payoff) − turn_cost − format_penalty,
 max(0, low_payoff, high_payoff) − turn_cost].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from arl.text import chunks, parsing, turn_text
from arl.envs.base import (NON_NEGATIVE, PROBABILITY, ParamRange, TokenChunk, TokenEnvironment,
                           TokenEnvState)
from arl.text.codec import CharCodec, Codec

INVALID_TEXT = "invalid"
PAYOFF_DIGITS = 4  # payoffs are shown as [0, 9999.99]


@struct.dataclass
class BanditParams:
    low_payoff: jax.Array  # float32, sure payoff of the low-risk arm
    high_payoff: jax.Array  # float32, payoff of the high-risk arm when it wins
    high_prob: jax.Array  # float32, win probability of the high-risk arm
    turn_cost: jax.Array
    format_penalty: jax.Array


@struct.dataclass
class BanditState(TokenEnvState):
    swapped: jax.Array  # bool: the prompt lists the high-risk arm first
    pulls: jax.Array  # int32 valid pulls so far


def payoff_chunk(codec: Codec, value: jax.Array) -> TokenChunk:
    """Text of `value` with two decimals, e.g. 0.15 -> "0.15" (value clipped to
    [0, 9999.99])."""
    cents = jnp.round(jnp.clip(value, 0.0, 9999.99) * 100).astype(jnp.int32)
    whole = chunks.int_chunk(codec, cents // 100, PAYOFF_DIGITS)
    dot = chunks.constant_chunk(codec, ".", 1)
    fraction = cents % 100
    two = chunks.digits_chunk(codec, fraction, 2)
    return chunks.concat_all([whole, dot, two], PAYOFF_DIGITS + 3, codec.pad_id)


class Bandit(TokenEnvironment):
    """Two-armed bandit; `num_pulls`, the arm names and `max_turns` are static."""

    name = "bandit"

    def __init__(self, codec: Codec | None = None, num_pulls: int = 1,
                 low_name: str = "phoenix", high_name: str = "dragon",
                 max_turns: int | None = None):
        if not isinstance(num_pulls, int) or num_pulls < 1:
            raise ValueError(f"num_pulls must be an int >= 1, got {num_pulls!r}")
        if not low_name or not high_name or low_name == high_name:
            raise ValueError(
                f"low_name and high_name must be distinct non-empty words, got "
                f"{low_name!r}, {high_name!r}")
        self.codec = codec or CharCodec()
        self.num_pulls = num_pulls
        self.max_turns = int(max_turns if max_turns is not None else num_pulls)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.low_name, self.high_name = low_name, high_name
        self._read = turn_text.TurnReader(self.codec)
        self.prompt_len = len("arms: ") + len(low_name) + 1 + len(high_name)
        self.obs_len = max(len(INVALID_TEXT), PAYOFF_DIGITS + 3)
        self.action_len = max(len(low_name), len(high_name)) + 1

    def default_params(self) -> BanditParams:
        return BanditParams(
            low_payoff=jnp.asarray(0.15, jnp.float32),
            high_payoff=jnp.asarray(1.0, jnp.float32),
            high_prob=jnp.asarray(0.25, jnp.float32),
            turn_cost=jnp.asarray(0.0, jnp.float32),
            format_penalty=jnp.asarray(0.1, jnp.float32),
        )

    def param_ranges(self):
        """Payoffs are shown with PAYOFF_DIGITS whole digits, so they must fit in
        [0, 9999.99]; costs and penalties are subtracted, so they are >= 0."""
        payoff = ParamRange(0.0, 9999.99)
        return dict(low_payoff=payoff, high_payoff=payoff, high_prob=PROBABILITY,
                    turn_cost=NON_NEGATIVE, format_penalty=NON_NEGATIVE)

    def reward_bounds(self, params: BanditParams):
        lowest = jnp.minimum(0.0, jnp.minimum(params.low_payoff, params.high_payoff))
        highest = jnp.maximum(0.0, jnp.maximum(params.low_payoff, params.high_payoff))
        return (lowest - params.turn_cost - params.format_penalty,
                highest - params.turn_cost)

    def best_arm_is_high(self, params: BanditParams) -> jax.Array:
        return params.high_prob * params.high_payoff > params.low_payoff

    def _reset(self, key, params):
        swapped = jax.random.bernoulli(key)
        false = jnp.zeros((), bool)
        state = BanditState(
            turn=jnp.zeros((), jnp.int32), terminated=false, truncated=false, success=false,
            swapped=swapped, pulls=jnp.zeros((), jnp.int32),
        )
        texts = [f"arms: {self.low_name} {self.high_name}", f"arms: {self.high_name} {self.low_name}"]
        return state, chunks.select_text(self.codec, swapped.astype(jnp.int32), texts,
                                         self.prompt_len)

    def _transition(self, key, state, content: TokenChunk, params):
        text = self._read(content)
        picks_low = parsing.equals(text.tokens, text.length, turn_text.text_ids(self.low_name))
        picks_high = parsing.equals(text.tokens, text.length,
                                    turn_text.text_ids(self.high_name))
        valid = picks_low | picks_high
        wins = jax.random.uniform(key) < params.high_prob
        payoff = jnp.where(picks_low, params.low_payoff,
                           jnp.where(picks_high & wins, params.high_payoff, 0.0))
        pulls = state.pulls + valid.astype(jnp.int32)
        best_high = self.best_arm_is_high(params)
        success = jnp.where(valid, jnp.where(best_high, picks_high, picks_low), state.success)
        new_state = state.replace(pulls=pulls, terminated=pulls >= self.num_pulls, success=success)
        reward = payoff - params.turn_cost - params.format_penalty * (~valid)
        shown = chunks.pad_chunk(payoff_chunk(self.codec, payoff), self.obs_len, self.codec.pad_id)
        invalid = chunks.constant_chunk(self.codec, INVALID_TEXT, self.obs_len)
        observation = jax.tree.map(lambda a, b: jnp.where(valid, a, b), shown, invalid)
        return new_state, observation, reward, ~valid

    def _arm_chunk(self, high: jax.Array) -> TokenChunk:
        turns = [chunks.with_eot(self.codec, self.low_name),
                 chunks.with_eot(self.codec, self.high_name)]
        return chunks.select_ids(self.codec, high.astype(jnp.int32), turns, self.action_len)

    def oracle_action(self, key, state, params: BanditParams) -> TokenChunk:
        """The arm with the higher expected payoff (the known optimum)."""
        del key, state
        return self._arm_chunk(self.best_arm_is_high(params))

    def demonstrator_action(self, key, state, params: BanditParams,
                            noise: float = 0.5) -> TokenChunk:
        """A weaker teacher: the worse arm with probability `noise`."""
        del state
        best = self.best_arm_is_high(params)
        return self._arm_chunk(jnp.where(jax.random.uniform(key) < noise, ~best, best))

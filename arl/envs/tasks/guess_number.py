"""`guess_number`: find a hidden integer in [0, N) from higher / lower replies.

Prompt: "guess 0-{N-1}". Each turn the agent writes just the number then end-of-turn
(e.g. "7<eot>"), read as text: "11" is eleven whether the codec spells it with one id or
two; the reply is "higher" (the hidden number is higher), "lower",
"correct" (episode terminates) or "invalid" (unparsable or out-of-range turn).

Reward per step: success_reward·[correct] − turn_cost − format_penalty·[malformed],
so a step's reward lies in [−(turn_cost + format_penalty), success_reward − turn_cost].

Process reward (`info["process_reward"]`, not part of the reward): the information the
guess gained, as a fraction of the information needed at the start,

    (log(size_before) − log(size_after)) / log(N),   size = high − low + 1,

where [low, high] is the interval of values consistent with the replies so far and a
correct guess collapses it to size 1. It telescopes: an episode that finds the number
collects exactly log(N)/log(N) = 1 in total (up to float32 rounding), whatever the
guesses; a truncated one collects log(N / size_left) / log(N) < 1. Malformed,
out-of-range and uninformative guesses (outside the consistent interval) give 0.
E.g. N = 16, hidden 11: "7" -> [8, 15], log(16/8)/log(16) = 0.25.

Partially observable; bisection is optimal and needs at most ceil(log2(N + 1)) guesses
(k guesses with three-way replies separate at most 2^k − 1 values).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from arl.text import chunks, parsing, turn_text
from arl.envs.base import NON_NEGATIVE, ParamRange, TokenChunk, TokenEnvironment, TokenEnvState
from arl.text.codec import CharCodec, Codec

REPLIES = ("higher", "lower", "correct", "invalid")
HIGHER, LOWER, CORRECT, INVALID = range(4)


@struct.dataclass
class GuessNumberParams:
    num_values: jax.Array  # int32 N; hidden number in [0, N); clipped to [2, max_n]
    turn_cost: jax.Array
    format_penalty: jax.Array
    success_reward: jax.Array


@struct.dataclass
class GuessNumberState(TokenEnvState):
    hidden: jax.Array  # int32
    low: jax.Array  # int32, smallest value consistent with the replies so far
    high: jax.Array  # int32, largest value consistent with the replies so far
    num_values: jax.Array  # int32 N of this episode


class GuessNumber(TokenEnvironment):
    """Guess-the-number. `max_n` (static) bounds N and fixes the token budgets;
    `num_values` in the params is the per-row N (data, <= max_n)."""

    name = "guess_number"

    def __init__(self, codec: Codec | None = None, max_n: int = 16, max_turns: int | None = None):
        if not isinstance(max_n, int) or not 2 <= max_n <= 10**8:
            raise ValueError(f"max_n must be an int in [2, 10**8], got {max_n!r}")
        self.codec = codec or CharCodec()
        self.max_n = max_n
        default_turns = math.ceil(math.log2(max_n)) + 2
        if max_turns is None:
            max_turns = default_turns
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = int(max_turns)
        self.num_digits = len(str(max_n - 1))
        # Lengths in tokens of the codec (not characters): a subword codec may spell
        # "guess 0-", "higher" or a number in fewer ids; never in more than one per digit.
        self._prefix_len = len(self.codec.encode("guess 0-"))
        self.prompt_len = self._prefix_len + self.num_digits
        self.obs_len = max(len(self.codec.encode(r)) for r in REPLIES)
        self.action_len = self.num_digits + 1
        self._read = turn_text.TurnReader(self.codec)

    def default_params(self, num_values: int | None = None) -> GuessNumberParams:
        num_values = self.max_n if num_values is None else num_values
        if not 2 <= num_values <= self.max_n:
            raise ValueError(f"num_values must be in [2, max_n={self.max_n}], got {num_values}")
        return GuessNumberParams(
            num_values=jnp.asarray(num_values, jnp.int32),
            turn_cost=jnp.asarray(0.05, jnp.float32),
            format_penalty=jnp.asarray(0.1, jnp.float32),
            success_reward=jnp.asarray(1.0, jnp.float32),
        )

    def param_ranges(self):
        """N in [2, max_n] (the token budgets are sized for max_n); rewards, costs and
        penalties >= 0."""
        return dict(num_values=ParamRange(2, self.max_n), turn_cost=NON_NEGATIVE,
                    format_penalty=NON_NEGATIVE, success_reward=NON_NEGATIVE)

    def reward_bounds(self, params: GuessNumberParams):
        low = -(params.turn_cost + params.format_penalty)
        high = params.success_reward - params.turn_cost
        return low, high

    def _reset(self, key, params):
        num_values = jnp.clip(params.num_values, 2, self.max_n).astype(jnp.int32)
        hidden = jax.random.randint(key, (), 0, num_values, jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        false = jnp.zeros((), bool)
        state = GuessNumberState(
            turn=zero, terminated=false, truncated=false, success=false,
            hidden=hidden, low=zero, high=num_values - 1, num_values=num_values,
        )
        prompt = chunks.concat_chunks(
            chunks.constant_chunk(self.codec, "guess 0-", self._prefix_len),
            chunks.int_chunk(self.codec, num_values - 1, max_digits=self.num_digits),
            self.prompt_len, self.codec.pad_id,
        )
        return state, prompt

    def _transition(self, key, state, content: TokenChunk, params):
        del key
        text = self._read(content)
        value, ok = parsing.parse_int(text.tokens, 0, text.length, turn_text.DIGIT_VALUE,
                                      turn_text.text_id("-"))
        valid = ok & (value >= 0) & (value < state.num_values)
        correct = valid & (value == state.hidden)
        reply = jnp.where(
            ~valid, INVALID,
            jnp.where(correct, CORRECT, jnp.where(state.hidden > value, HIGHER, LOWER)),
        )
        low = jnp.where(valid & (value < state.hidden), jnp.maximum(state.low, value + 1), state.low)
        high = jnp.where(valid & (value > state.hidden), jnp.minimum(state.high, value - 1), state.high)
        new_state = state.replace(low=low, high=high, terminated=correct, success=correct)
        reward = (
            params.success_reward * correct
            - params.turn_cost
            - params.format_penalty * (~valid)
        )
        observation = chunks.select_text(self.codec, reply, REPLIES, self.obs_len)
        return new_state, observation, reward, ~valid

    def process_reward(self, old_state: GuessNumberState, new_state: GuessNumberState,
                       params) -> jax.Array:
        """Information gained: (log|I_before| − log|I_after|) / log N, with |I| = 1 once
        the number is found (see the module docstring)."""
        del params
        size_before = (old_state.high - old_state.low + 1).astype(jnp.float32)
        size_after = jnp.where(new_state.success, 1,
                               new_state.high - new_state.low + 1).astype(jnp.float32)
        total = jnp.log(jnp.maximum(new_state.num_values, 2).astype(jnp.float32))
        gained = jnp.log(jnp.maximum(size_before, 1.0)) - jnp.log(jnp.maximum(size_after, 1.0))
        return (gained / total).astype(jnp.float32)

    def _guess_chunk(self, guess: jax.Array) -> TokenChunk:
        eot = TokenChunk(jnp.asarray([self.codec.eot_id], jnp.int32), jnp.asarray(1, jnp.int32))
        return chunks.concat_chunks(
            chunks.int_chunk(self.codec, guess, max_digits=self.num_digits),
            eot, self.action_len, self.codec.pad_id,
        )

    def oracle_action(self, key, state: GuessNumberState, params) -> TokenChunk:
        """Bisection on the interval consistent with the replies (the optimum; it does
        not peek at the hidden number)."""
        del key, params
        return self._guess_chunk((state.low + state.high) // 2)

    def demonstrator_action(self, key, state: GuessNumberState, params,
                            noise: float = 0.5) -> TokenChunk:
        """A weaker teacher: with probability `noise` a uniformly random number from the
        consistent interval, else the bisection midpoint. Never wrong, often slower."""
        del params
        key_coin, key_guess = jax.random.split(key)
        random_guess = jax.random.randint(key_guess, (), state.low, state.high + 1, jnp.int32)
        guess = jnp.where(
            jax.random.uniform(key_coin) < noise, random_guess, (state.low + state.high) // 2
        )
        return self._guess_chunk(guess)

"""`calculator`: answer a d-digit arithmetic question, optionally using a tool.

Prompt: e.g. "47*86". Each agent turn is exactly one of
  "<calc>EXPR</calc>"   EXPR = INT OP INT (OP one of + - *, ints may be negative);
                        the pure-JAX tool evaluates it and the result ("4042") is the
                        next observation;
  "<answer>N</answer>"  ends the episode: reply "correct" or "wrong".
Anything else is a format error with an error reply: "bad expression" (calc tag with an
unparsable expression), "overflow" (a tool result with |value| >= 2e9), "bad answer"
(answer tag without an integer), "unknown tool" ("<name>..." with another tag),
"invalid" (no tag at all, empty turn, unclosed or mismatched tag).

Reward per step: success_reward·[correct answer] − turn_cost − format_penalty·[malformed],
in [−(turn_cost + format_penalty), success_reward − turn_cost]. A wrong answer ends the
episode with −turn_cost.

Process reward (`info["process_reward"]`, not part of the reward): 1 on the turn the
task's answer first appears in the conversation — a tool call whose result equals the
answer (e.g. "<calc>47*86</calc>", or any expression with the same value), or a correct
answer given without one — and 0 on every other turn (malformed turns included). So a
successful episode collects exactly 1; one that never gets the answer collects 0; a
correct tool call followed by a wrong answer still collects 1 (the progress was made,
the outcome reward says it was thrown away).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from arl.envs.tasks import arithmetic

from arl.text import chunks, parsing, turn_text
from arl.envs.base import (NON_NEGATIVE, ParamRange, TokenChunk, TokenEnvironment,
                           TokenEnvState, tree_select)
from arl.text.codec import CharCodec, Codec

OPERATORS = arithmetic.OPERATORS[:arithmetic.DIV]  # + - *: the tool's results are integers
REPLIES = ("correct", "wrong", "bad expression", "overflow", "bad answer", "unknown tool",
           "invalid")
CORRECT, WRONG, BAD_EXPRESSION, OVERFLOW, BAD_ANSWER, UNKNOWN_TOOL, INVALID = range(7)
MAX_OPERAND_DIGITS = 9


@struct.dataclass
class CalculatorParams:
    digits: jax.Array  # int32 d, operand digits, clipped to [1, max_digits]
    operators: jax.Array  # bool [3]: which of + - * may be asked (all False -> all)
    turn_cost: jax.Array
    format_penalty: jax.Array
    success_reward: jax.Array


@struct.dataclass
class CalculatorState(TokenEnvState):
    left: jax.Array  # int32
    right: jax.Array  # int32
    operator: jax.Array  # int32 index into "+-*"
    answer: jax.Array  # int32
    tool_calls: jax.Array  # int32
    answer_seen: jax.Array  # bool: a tool result or an answer equal to `answer` so far


class Calculator(TokenEnvironment):
    """Arithmetic with a calculator tool. `max_digits` (static) bounds the operand
    digits and fixes the token budgets; params.digits is the per-row difficulty."""

    name = "calculator"

    def __init__(self, codec: Codec | None = None, max_digits: int = 2, max_turns: int = 4):
        if not isinstance(max_digits, int) or not 1 <= max_digits <= 4:
            raise ValueError(f"max_digits must be an int in [1, 4], got {max_digits!r}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.codec = codec or CharCodec()
        self.max_digits = max_digits
        self.max_turns = int(max_turns)
        self.prompt_len = 2 * max_digits + 1
        self.result_digits = 10
        enc = self.codec.encode
        self._calc_open, self._calc_close = enc("<calc>"), enc("</calc>")
        self._answer_open, self._answer_close = enc("<answer>"), enc("</answer>")
        # Lengths in tokens of the codec (a subword codec may spell a reply, a tag or a
        # number in fewer ids than characters; never a number in more than its digits).
        self.obs_len = max(max(len(enc(r)) for r in REPLIES), self.result_digits + 1)
        answer_width = 2 * max_digits + 1
        self.action_len = max(
            len(self._answer_open) + answer_width + len(self._answer_close),
            len(self._calc_open) + 2 * max_digits + 1 + len(self._calc_close),
        ) + 1
        self._operator_ids = [self.codec.token_id(c) for c in OPERATORS]
        # The agent's turn is read as text (any spelling in ids of the same characters).
        self._read = turn_text.TurnReader(self.codec)

    def default_params(self, digits: int | None = None) -> CalculatorParams:
        digits = self.max_digits if digits is None else digits
        if not 1 <= digits <= self.max_digits:
            raise ValueError(f"digits must be in [1, max_digits={self.max_digits}], got {digits}")
        return CalculatorParams(
            digits=jnp.asarray(digits, jnp.int32),
            operators=jnp.ones((3,), bool),
            turn_cost=jnp.asarray(0.0, jnp.float32),
            format_penalty=jnp.asarray(0.1, jnp.float32),
            success_reward=jnp.asarray(1.0, jnp.float32),
        )

    def param_ranges(self):
        """Operand digits in [1, max_digits] (the token budgets are sized for
        max_digits); rewards, costs and penalties >= 0."""
        return dict(digits=ParamRange(1, self.max_digits), turn_cost=NON_NEGATIVE,
                    format_penalty=NON_NEGATIVE, success_reward=NON_NEGATIVE)

    def reward_bounds(self, params: CalculatorParams):
        return -(params.turn_cost + params.format_penalty), params.success_reward - params.turn_cost

    def _info(self, state, format_error):
        info = super()._info(state, format_error)
        info["tool_calls"] = state.tool_calls
        return info

    def _reset(self, key, params):
        key_left, key_right, key_op = jax.random.split(key, 3)
        digits = jnp.clip(params.digits, 1, self.max_digits)
        high = (10 ** digits).astype(jnp.int32)
        low = jnp.where(digits > 1, 10 ** (digits - 1), 0).astype(jnp.int32)
        left = jax.random.randint(key_left, (), low, high, jnp.int32)
        right = jax.random.randint(key_right, (), low, high, jnp.int32)
        allowed = jnp.where(jnp.any(params.operators), params.operators, True)
        operator = jax.random.categorical(key_op, jnp.where(allowed, 0.0, -jnp.inf)).astype(jnp.int32)
        answer, _ = arithmetic.apply_integer(left, operator, right)
        false = jnp.zeros((), bool)
        zero = jnp.zeros((), jnp.int32)
        state = CalculatorState(
            turn=zero, terminated=false, truncated=false, success=false,
            left=left, right=right, operator=operator, answer=answer, tool_calls=zero,
            answer_seen=false,
        )
        return state, self._expression_chunk(left, operator, right, self.prompt_len)

    def _expression_chunk(self, left, operator, right, size) -> TokenChunk:
        op = TokenChunk(jnp.asarray(self._operator_ids, jnp.int32)[operator][None],
                        jnp.asarray(1, jnp.int32))
        return chunks.concat_all(
            [chunks.int_chunk(self.codec, left), op, chunks.int_chunk(self.codec, right)],
            size, self.codec.pad_id,
        )

    def _parse_expression(self, chars, start, end):
        """(left, operator, right, ok) of chars[start:end] = INT OP INT."""
        pos = jnp.arange(chars.shape[-1])
        operators = jnp.asarray(turn_text.text_ids(OPERATORS), jnp.int32)
        is_op = jnp.isin(chars, operators)
        # The operator is the first + - * after the first character (which may be a sign).
        candidates = is_op & (pos > start) & (pos < end)
        op_pos = jnp.where(jnp.any(candidates), jnp.argmax(candidates), -1)
        op_char = jnp.take(chars, jnp.clip(op_pos, 0, chars.shape[-1] - 1))
        operator = jnp.argmax(operators == op_char).astype(jnp.int32)
        minus = turn_text.text_id("-")
        left, ok_left = parsing.parse_int(chars, start, op_pos, turn_text.DIGIT_VALUE, minus,
                                          MAX_OPERAND_DIGITS)
        right, ok_right = parsing.parse_int(chars, op_pos + 1, end, turn_text.DIGIT_VALUE,
                                            minus, MAX_OPERAND_DIGITS)
        return left, operator, right, (op_pos >= 0) & ok_left & ok_right

    def _transition(self, key, state, content: TokenChunk, params):
        del key
        text = self._read(content)
        chars, length = text.tokens, text.length
        calc_open, calc_close = turn_text.text_ids("<calc>"), turn_text.text_ids("</calc>")
        answer_open = turn_text.text_ids("<answer>")
        answer_close = turn_text.text_ids("</answer>")
        is_calc = (
            parsing.starts_with(chars, length, calc_open)
            & parsing.ends_with(chars, length, calc_close)
            & (length >= len(calc_open) + len(calc_close))
        )
        is_answer = (
            parsing.starts_with(chars, length, answer_open)
            & parsing.ends_with(chars, length, answer_close)
            & (length >= len(answer_open) + len(answer_close))
        )
        # "<name>" with a name that is neither tool: a call to an unknown tool.
        close_pos = parsing.find_token(chars, length, turn_text.text_id(">"), start=1)
        is_tag = ((jnp.take(chars, 0) == turn_text.text_id("<")) & (length > 0)
                  & (close_pos >= 2))
        is_unknown = (is_tag & ~parsing.starts_with(chars, length, calc_open)
                      & ~parsing.starts_with(chars, length, answer_open))

        left, operator, right, ok_expr = self._parse_expression(
            chars, len(calc_open), length - len(calc_close))
        result, overflow = arithmetic.apply_integer(left, operator, right)
        answer, ok_answer = parsing.parse_int(
            chars, len(answer_open), length - len(answer_close),
            turn_text.DIGIT_VALUE, turn_text.text_id("-"), MAX_OPERAND_DIGITS)

        calc_ok = is_calc & ok_expr & ~overflow
        answer_ok = is_answer & ok_answer
        correct = answer_ok & (answer == state.answer)
        reply = jnp.select(
            [calc_ok, correct, answer_ok, is_calc & ~ok_expr, is_calc & overflow,
             is_answer, is_unknown],
            [-1, CORRECT, WRONG, BAD_EXPRESSION, OVERFLOW, BAD_ANSWER, UNKNOWN_TOOL],
            INVALID,
        )
        format_error = ~(calc_ok | answer_ok)
        text = chunks.select_text(self.codec, reply, REPLIES, self.obs_len)
        number = chunks.pad_chunk(chunks.int_chunk(self.codec, result, self.result_digits),
                                  self.obs_len, self.codec.pad_id)
        observation = jax.tree.map(lambda a, b: jnp.where(calc_ok, a, b), number, text)
        new_state = state.replace(
            terminated=answer_ok, success=correct,
            tool_calls=state.tool_calls + calc_ok.astype(jnp.int32),
            answer_seen=state.answer_seen | (calc_ok & (result == state.answer)) | correct,
        )
        reward = (params.success_reward * correct - params.turn_cost
                  - params.format_penalty * format_error)
        return new_state, observation, reward, format_error

    def process_reward(self, old_state: CalculatorState, new_state: CalculatorState,
                       params) -> jax.Array:
        """1 on the turn the answer first appears (tool result or correct answer)."""
        del params
        return (new_state.answer_seen & ~old_state.answer_seen).astype(jnp.float32)

    # -- teachers
    def _wrap(self, open_ids, body: TokenChunk, close_ids) -> TokenChunk:
        def const(ids):
            return TokenChunk(jnp.asarray(ids, jnp.int32), jnp.asarray(len(ids), jnp.int32))
        eot = const([self.codec.eot_id])
        return chunks.concat_all([const(open_ids), body, const(close_ids), eot],
                                 self.action_len, self.codec.pad_id)

    def _answer_action(self, value) -> TokenChunk:
        return self._wrap(self._answer_open, chunks.int_chunk(self.codec, value),
                          self._answer_close)

    def _calc_action(self, state) -> TokenChunk:
        expression = self._expression_chunk(state.left, state.operator, state.right,
                                            2 * self.max_digits + 1)
        return self._wrap(self._calc_open, expression, self._calc_close)

    def oracle_action(self, key, state: CalculatorState, params) -> TokenChunk:
        """Call the tool on the question, then answer with the tool's result."""
        del key, params
        return tree_select(state.tool_calls == 0, self._calc_action(state),
                          self._answer_action(state.answer))

    def demonstrator_action(self, key, state: CalculatorState, params,
                            skip_tool: float = 0.5, mental_error: float = 0.5) -> TokenChunk:
        """A weaker teacher: on its first turn it skips the tool with probability
        `skip_tool` and answers from "mental arithmetic", which is off by a random
        non-zero amount in [-10, 10] with probability `mental_error`."""
        del params
        key_skip, key_err, key_delta, key_sign = jax.random.split(key, 4)
        skip = (state.tool_calls == 0) & (jax.random.uniform(key_skip) < skip_tool)
        delta = jax.random.randint(key_delta, (), 1, 11) * jnp.where(
            jax.random.uniform(key_sign) < 0.5, -1, 1)
        mental = state.answer + jnp.where(jax.random.uniform(key_err) < mental_error, delta, 0)
        oracle = self.oracle_action(key, state, None)
        return tree_select(skip, self._answer_action(mental), oracle)

"""`countdown`: TinyZero's Countdown, reach a target with + − * / over given numbers.

Prompt: "numbers 3 7 25 50 target 68". A turn is exactly "<answer>EXPR</answer>" then
end-of-turn (TinyZero instead takes the last answer tag of a longer completion), EXPR an
arithmetic expression over non-negative integer literals with + − * /, parentheses and
spaces (the codec's one-token " ") anywhere except inside a number, e.g.
"<answer>(50-25)*3-7</answer>" or "<answer>50 + 25 - 7</answer>". The grammar is
Python's for these tokens; the expression is parsed and evaluated inside `jit` as exact
rationals by `arl.envs.tasks.arithmetic.ExpressionParser` (a division by zero makes the value
undefined, never NaN, never a crash). The constructor demands
2^(max_numbers−1) · max_number^max_numbers < 2^31, which bounds every intermediate
numerator and denominator of a LEGAL expression (each given number used at most once;
each binary operation multiplies the bounds of disjoint sets of numbers, times 2 for
+ −), so legal expressions never overflow. Illegal ones may wrap around in int32; their
value is never used.

Verifier (TinyZero's `compute_score`, Pan et al. 2025): a turn scores

    0              no "<answer>…</answer>" turn or an expression outside the grammar;
    format_score   (0.1) well formed, but a number not among the given ones, a given
                   number used more often than given, (with `use_all_numbers`, TinyZero's
                   rule) not every number used, a division by zero, or a wrong value;
    success_score  (1.0) legal and exactly the target.

TinyZero gives the format score also to an answer tag around text it cannot evaluate;
here that is malformed (0), as is a decimal point (TinyZero's character filter lets "."
through; all numbers are integers). With `use_all_numbers` False each number may be used
at most once (the classic game's rule).

Multi-turn: a correct answer terminates with success; otherwise the reply is feedback
and the agent may retry until `max_turns`: "wrong: V" (the expression's integer value),
"wrong: fraction", "wrong: undefined" (division by zero), "illegal numbers", "invalid"
(malformed). The reward of a turn is the improvement of the best score so far,

    reward_t = max(score_t, best_{t−1}) − best_{t−1},   best_0 = 0,

so an episode's return is the TinyZero score of its best answer (exactly TinyZero's
single-turn reward when max_turns = 1), retrying never costs and never pays twice.

Tasks: `num_numbers` numbers drawn uniformly from [number_min, number_max]; a random
expression over ALL of them (random adjacent pairs merged with random allowed operators,
no division by zero) gives the target, so every task is solvable under either rule. Up to
256 draws are made (16 at a time) until the target is an integer in [target_min,
target_max]; if none is, the target is the sum of the last draw's numbers (a fallback the
tests measure as rare at the defaults). The numbers are shown shuffled. Difficulty knobs
(params): num_numbers, the number range, the target range and the operators the
generator may use.

Oracle: writes the generating expression (fully parenthesised, outer parentheses
dropped), correct on the first turn. Demonstrator: a greedy player without search: it
takes the numbers in a random order and combines them left to right, each time with the
operator that brings the running value closest to the target; each retry tries a new
order. At the defaults (3 numbers in [1, 99], targets in [1, 100], 3 turns) the oracle
solves every task and the demonstrator about half of them (measured in the tests).

Process reward (`info["process_reward"]`, not part of the reward): the improvement of the
best closeness so far, closeness = 1 − |value − target| / target clipped to [0, 0.99] for
a legal, defined, wrong value, 1 for the target and 0 otherwise. It telescopes to the best
closeness of the episode: exactly 1 when solved, below 1 otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from arl.envs.tasks import arithmetic

from arl.text import chunks, parsing, seams, turn_text
from arl.envs.tasks.arithmetic import ADD, DIV, OPERATORS
from arl.envs.base import (NON_NEGATIVE, ParamRange, TokenChunk, TokenEnvironment, TokenEnvState,
                           tree_select)
from arl.text.codec import CharCodec, Codec

REPLIES = ("correct", "wrong: fraction", "wrong: undefined", "illegal numbers", "invalid")
CORRECT, FRACTION, UNDEFINED, ILLEGAL, INVALID = range(5)
WRONG_VALUE = len(REPLIES)  # "wrong: V"
WRONG_PREFIX = "wrong: "
MAX_TRIES = 16  # tries of DRAWS_PER_TRY draws each
DRAWS_PER_TRY = 16
WRONG_CLOSENESS_CAP = 0.99


def legal_numbers(literals, num_literals, numbers, num_numbers, use_all_numbers):
    """bool: the literals use each given number at most as often as it is given (and,
    with `use_all_numbers`, every given number: equal multisets, TinyZero's rule)."""
    used = jnp.arange(literals.shape[-1]) < num_literals
    given = jnp.arange(numbers.shape[-1]) < num_numbers
    times_used = jnp.sum(used[None, :] & (literals[None, :] == literals[:, None]), axis=1)
    times_given = jnp.sum(given[None, :] & (numbers[None, :] == literals[:, None]), axis=1)
    at_most_once = jnp.all(~used | (times_used <= times_given))
    return at_most_once & (~use_all_numbers | (num_literals == num_numbers))


@struct.dataclass
class CountdownParams:
    num_numbers: jax.Array  # int32, clipped to [2, max_numbers]
    number_min: jax.Array  # int32, numbers are drawn from [number_min, number_max]
    number_max: jax.Array  # int32 (both clipped to [1, max_number])
    target_min: jax.Array  # int32, wanted target range (clipped to [1, max_target])
    target_max: jax.Array  # int32
    operators: jax.Array  # bool [4]: which of + - * / the generator uses (none -> all)
    use_all_numbers: jax.Array  # bool: TinyZero's exactly-once rule (else at most once)
    format_score: jax.Array  # float32, a well-formed answer that is not the target
    success_score: jax.Array  # float32, the target


@struct.dataclass
class CountdownState(TokenEnvState):
    numbers: jax.Array  # int32 [max_numbers], as shown (0 past num_numbers)
    num_numbers: jax.Array  # int32
    target: jax.Array  # int32
    solution: jax.Array  # int32 [expression_len] token ids of the generating expression
    solution_len: jax.Array  # int32
    best_score: jax.Array  # float32, best verifier score so far
    best_closeness: jax.Array  # float32, best closeness so far (process reward)


class Countdown(TokenEnvironment):
    """Countdown with up to `max_numbers` numbers of at most `max_number` and targets up
    to `max_target` (static: they fix the token budgets); the per-row difficulty is in
    the params."""

    name = "countdown"

    def __init__(self, codec: Codec | None = None, max_numbers: int = 4, max_number: int = 99,
                 max_target: int = 999, max_turns: int = 3):
        if not isinstance(max_numbers, int) or not 2 <= max_numbers <= 6:
            raise ValueError(f"max_numbers must be an int in [2, 6], got {max_numbers!r}")
        if not isinstance(max_number, int) or max_number < 1:
            raise ValueError(f"max_number must be an int >= 1, got {max_number!r}")
        bound = 2 ** (max_numbers - 1) * max_number ** max_numbers
        if bound >= 2**31:
            raise ValueError(
                f"max_numbers={max_numbers} and max_number={max_number} allow legal "
                f"expressions whose intermediate values overflow int32: "
                f"2**(max_numbers-1) * max_number**max_numbers = {bound} must be < 2**31 "
                f"(e.g. max_numbers=4 with max_number <= 99, or 5 with <= 30)")
        if not isinstance(max_target, int) or not 1 <= max_target < 10**9:
            raise ValueError(f"max_target must be an int in [1, 10**9), got {max_target!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.codec = codec or CharCodec()
        self.max_numbers, self.max_number, self.max_target = max_numbers, max_number, max_target
        self.max_turns = max_turns
        self.number_digits = len(str(max_number))
        # The sum fallback can exceed max_target: show up to max_numbers * max_number.
        self.target_digits = len(str(max(max_target, max_numbers * max_number)))
        enc = self.codec.encode
        self.parser = arithmetic.ExpressionParser(self.codec)
        self._operator_ids = self.parser.operator_ids
        self._open_ids, self._close_ids = enc("<answer>"), enc("</answer>")
        # The agent's turn is read as text and parsed on code points.
        self._read = turn_text.TurnReader(self.codec)
        self._text_parser = arithmetic.ExpressionParser(turn_text.CODE_POINTS)
        self._space_len = len(enc(" "))
        self._prefix_len, self._mid_len = len(enc("numbers")), len(enc(" target "))
        # Fully parenthesised: numbers, operators and two parentheses per operator.
        self.expression_len = max_numbers * self.number_digits + 3 * (max_numbers - 1)
        self.prompt_len = (self._prefix_len + max_numbers * (self._space_len + self.number_digits)
                           + self._mid_len + self.target_digits)
        # "wrong: -162": the sign is tokenized with the space before it (" -" merges).
        self._wrong = seams.NumberInText(self.codec, WRONG_PREFIX, "", 10)
        self.obs_len = max(max(len(enc(r)) for r in REPLIES), self._wrong.size)
        self.action_len = len(self._open_ids) + self.expression_len + len(self._close_ids) + 1

    def default_params(self, num_numbers: int = 3, number_range: tuple[int, int] | None = None,
                       target_range: tuple[int, int] | None = None,
                       use_all_numbers: bool = True, operators: str = OPERATORS
                       ) -> CountdownParams:
        number_range = (1, self.max_number) if number_range is None else tuple(number_range)
        target_range = (1, min(100, self.max_target)) if target_range is None else tuple(
            target_range)
        if not 2 <= num_numbers <= self.max_numbers:
            raise ValueError(f"num_numbers must be in [2, max_numbers={self.max_numbers}], "
                             f"got {num_numbers}")
        if not 1 <= number_range[0] <= number_range[1] <= self.max_number:
            raise ValueError(f"number_range must be (low, high) with 1 <= low <= high <= "
                             f"max_number={self.max_number}, got {number_range}")
        if not 1 <= target_range[0] <= target_range[1] <= self.max_target:
            raise ValueError(f"target_range must be (low, high) with 1 <= low <= high <= "
                             f"max_target={self.max_target}, got {target_range}")
        if not operators or any(op not in OPERATORS for op in operators):
            raise ValueError(f"operators must be a non-empty string of {OPERATORS!r}, got "
                             f"{operators!r}")
        i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
        return CountdownParams(
            num_numbers=i32(num_numbers), number_min=i32(number_range[0]),
            number_max=i32(number_range[1]), target_min=i32(target_range[0]),
            target_max=i32(target_range[1]),
            operators=jnp.asarray([op in operators for op in OPERATORS]),
            use_all_numbers=jnp.asarray(use_all_numbers, bool),
            format_score=jnp.asarray(0.1, jnp.float32),
            success_score=jnp.asarray(1.0, jnp.float32))

    def param_ranges(self):
        """Counts and ranges up to the static bounds the token budgets were sized for;
        scores >= 0 (the reward is the improvement of the best score, from 0). A range's
        ends are checked one at a time (min <= max is not)."""
        numbers, targets = ParamRange(1, self.max_number), ParamRange(1, self.max_target)
        return dict(num_numbers=ParamRange(2, self.max_numbers), number_min=numbers,
                    number_max=numbers, target_min=targets, target_max=targets,
                    format_score=NON_NEGATIVE, success_score=NON_NEGATIVE)

    def reward_bounds(self, params: CountdownParams):
        """The improvement of the best score, from best >= 0 to at most the top score."""
        zero = jnp.zeros((), jnp.float32)
        return zero, jnp.maximum(zero, jnp.maximum(params.format_score, params.success_score))

    # ------------------------------------------------------------------ tasks
    def _number_chunk(self, value, shown=True) -> TokenChunk:
        chunk = chunks.int_chunk(self.codec, value, self.target_digits)
        return chunk.replace(length=jnp.where(shown, chunk.length, 0))

    def _constant(self, text: str, shown=True) -> TokenChunk:
        chunk = chunks.constant_chunk(self.codec, text, len(self.codec.encode(text)))
        return chunk.replace(length=jnp.where(shown, chunk.length, 0))

    @staticmethod
    def _shift_merge(values, pos, merged):
        """values [size, ...] with entries pos and pos + 1 replaced by `merged`."""
        size = values.shape[0]
        following = values[jnp.minimum(jnp.arange(size) + 1, size - 1)]
        index = jnp.arange(size).reshape((-1,) + (1,) * (values.ndim - 1))
        return jnp.where(index < pos, values, jnp.where(index == pos, merged[None], following))

    def _draw(self, key, params: CountdownParams, n):
        """One random expression over n drawn numbers, values only: (numbers
        [max_numbers], value num/den not reduced, merge positions [max_numbers-1], operators
        [max_numbers-1]); merge k combines items pos_k and pos_k + 1 of the list left
        by the earlier merges."""
        size = self.max_numbers
        low = jnp.clip(params.number_min, 1, self.max_number)
        high = jnp.clip(params.number_max, low, self.max_number)
        key_numbers, key_merges = jax.random.split(key)
        numbers = jax.random.randint(key_numbers, (size,), low, high + 1, jnp.int32)
        numbers = jnp.where(jnp.arange(size) < n, numbers, 0)
        num, den = numbers, jnp.ones((size,), jnp.int32)
        allowed = jnp.where(jnp.any(params.operators), params.operators, True)
        positions, operators = [], []
        for step, key_step in enumerate(jax.random.split(key_merges, size - 1)):
            key_pos, key_op = jax.random.split(key_step)
            pos = jax.random.randint(key_pos, (), 0, jnp.maximum(n - step - 1, 1), jnp.int32)
            operator = jax.random.categorical(key_op, jnp.where(allowed, 0.0, -jnp.inf))
            right = jnp.minimum(pos + 1, size - 1)
            operator = jnp.where((operator == DIV) & (num[right] == 0), ADD, operator)
            new_num, new_den = arithmetic.apply_rational(num[pos], den[pos], operator, num[right], den[right])
            live = step < n - 1
            num = jnp.where(live, self._shift_merge(num, pos, new_num), num)
            den = jnp.where(live, self._shift_merge(den, pos, new_den), den)
            positions.append(pos)
            operators.append(operator.astype(jnp.int32))
        return numbers, num[0], den[0], jnp.stack(positions), jnp.stack(operators)

    def expression_chunk(self, numbers, n, positions, operators) -> TokenChunk:
        """Text of a drawn expression, fully parenthesised without the outer pair, e.g.
        "(89+1)+10", of static size expression_len."""
        size, width = self.max_numbers, self.expression_len
        texts = jax.vmap(lambda v: chunks.pad_chunk(self._number_chunk(v), width,
                                                    self.codec.pad_id))(numbers)
        tokens, lengths = texts.tokens, texts.length
        for step in range(size - 1):
            pos, operator = positions[step], operators[step]
            right = jnp.minimum(pos + 1, size - 1)
            op_chunk = TokenChunk(jnp.asarray(self._operator_ids)[operator][None],
                                  jnp.ones((), jnp.int32))
            text = chunks.concat_all(
                [self._constant("("), TokenChunk(tokens[pos], lengths[pos]), op_chunk,
                 TokenChunk(tokens[right], lengths[right]), self._constant(")")],
                width, self.codec.pad_id)
            live = step < n - 1
            tokens = jnp.where(live, self._shift_merge(tokens, pos, text.tokens), tokens)
            lengths = jnp.where(live, self._shift_merge(lengths, pos, text.length), lengths)
        # Drop the outer parentheses (n >= 2, so the expression is a combination).
        length = lengths[0] - 2
        shifted = jnp.concatenate([tokens[0][1:], jnp.full((1,), self.codec.pad_id)])
        shifted = jnp.where(jnp.arange(width) < length, shifted, self.codec.pad_id)
        return TokenChunk(shifted.astype(jnp.int32), length.astype(jnp.int32))

    def generate(self, key, params: CountdownParams):
        """(numbers as drawn, n, target, expression chunk): a solvable task, with the
        target in range when one of the MAX_TRIES * DRAWS_PER_TRY draws gets there."""
        n = jnp.clip(params.num_numbers, 2, self.max_numbers).astype(jnp.int32)
        t_low = jnp.clip(params.target_min, 1, self.max_target)
        t_high = jnp.clip(params.target_max, t_low, self.max_target)

        def attempt(key):
            # DRAWS_PER_TRY draws side by side: a while_loop iteration costs about the same
            # for one or many, and the loop runs until the unluckiest row succeeds.
            numbers, num, den, positions, operators = jax.vmap(
                lambda k: self._draw(k, params, n))(jax.random.split(key, DRAWS_PER_TRY))
            safe_den = jnp.where(den == 0, 1, den)
            value = num // safe_den  # exact when den divides num
            ok = (den != 0) & (num % safe_den == 0) & (value >= t_low) & (value <= t_high)
            pick = jnp.argmax(ok)
            return dict(numbers=numbers[pick], target=value[pick], positions=positions[pick],
                        operators=operators[pick], ok=ok[pick])

        def cond(carry):
            tries, _, task = carry
            return ~task["ok"] & (tries < MAX_TRIES)

        def body(carry):
            tries, key, _ = carry
            key, sub = jax.random.split(key)
            return tries + 1, key, attempt(sub)

        key_first, key_rest = jax.random.split(key)
        _, _, task = jax.lax.while_loop(
            cond, body, (jnp.ones((), jnp.int32), key_rest, attempt(key_first)))
        expression = self.expression_chunk(task["numbers"], n, task["positions"],
                                           task["operators"])
        # Fallback: the sum of the last draw's numbers (always a positive integer).
        total = self.expression_chunk(task["numbers"], n, jnp.zeros_like(task["positions"]),
                                      jnp.full_like(task["operators"], ADD))
        expression = tree_select(task["ok"], expression, total)
        target = jnp.where(task["ok"], task["target"], jnp.sum(task["numbers"]))
        return task["numbers"], n, target.astype(jnp.int32), expression

    def _reset(self, key, params):
        key_task, key_shuffle = jax.random.split(key)
        numbers, n, target, expression = self.generate(key_task, params)
        index = jnp.arange(self.max_numbers)
        shown = jnp.where(index < n, jax.random.uniform(key_shuffle, index.shape), 2.0)
        order = jnp.argsort(shown)
        numbers = numbers[order]
        false = jnp.zeros((), bool)
        zero = jnp.zeros((), jnp.float32)
        state = CountdownState(
            turn=jnp.zeros((), jnp.int32), terminated=false, truncated=false, success=false,
            numbers=numbers, num_numbers=n, target=target, solution=expression.tokens,
            solution_len=expression.length,
            best_score=zero, best_closeness=zero)
        return state, self.prompt_chunk(numbers, n, target)

    def prompt_chunk(self, numbers, n, target) -> TokenChunk:
        """"numbers 3 7 25 50 target 68"."""
        pieces = [self._constant("numbers")]
        for i in range(self.max_numbers):
            shown = i < n
            pieces += [self._constant(" ", shown), self._number_chunk(numbers[i], shown)]
        pieces += [self._constant(" target "), self._number_chunk(target)]
        return chunks.concat_all(pieces, self.prompt_len, self.codec.pad_id)

    # --------------------------------------------------------------- verifier
    def verify(self, state: CountdownState, content: TokenChunk, params: CountdownParams):
        """(reply index, score, closeness, evaluation) of one turn's content."""
        text = self._read(content)
        chars, length = text.tokens, text.length
        open_text, close_text = turn_text.text_ids("<answer>"), turn_text.text_ids("</answer>")
        n_open, n_close = len(open_text), len(close_text)
        tagged = (parsing.starts_with(chars, length, open_text)
                  & parsing.ends_with(chars, length, close_text)
                  & (length >= n_open + n_close))
        ev = self._text_parser(chars, n_open, length - n_close)
        well_formed = tagged & ev.well_formed
        legal = legal_numbers(ev.literals, ev.num_literals, state.numbers, state.num_numbers,
                              params.use_all_numbers)
        integer = ~ev.undefined & (ev.denominator == 1)
        correct = well_formed & legal & integer & (ev.numerator == state.target)
        reply = jnp.select(
            [~well_formed, ~legal, ev.undefined, ~integer, correct],
            [INVALID, ILLEGAL, UNDEFINED, FRACTION, CORRECT], WRONG_VALUE)
        score = jnp.where(correct, params.success_score,
                          jnp.where(well_formed, params.format_score, 0.0))
        target = jnp.maximum(state.target, 1).astype(jnp.float32)
        value = (ev.numerator.astype(jnp.float32)
                 / jnp.maximum(ev.denominator, 1).astype(jnp.float32))
        near = jnp.clip(1.0 - jnp.abs(value - target) / target, 0.0, WRONG_CLOSENESS_CAP)
        closeness = jnp.where(correct, 1.0, jnp.where(well_formed & legal & ~ev.undefined,
                                                      near, 0.0))
        return reply, score.astype(jnp.float32), closeness.astype(jnp.float32), ev

    def _transition(self, key, state, content: TokenChunk, params):
        del key
        reply, score, closeness, ev = self.verify(state, content, params)
        correct = reply == CORRECT
        best = jnp.maximum(state.best_score, score)
        new_state = state.replace(
            terminated=correct, success=correct, best_score=best,
            best_closeness=jnp.maximum(state.best_closeness, closeness))
        text = chunks.select_text(self.codec, jnp.minimum(reply, len(REPLIES) - 1), REPLIES,
                                  self.obs_len)
        wrong = chunks.pad_chunk(self._wrong(ev.numerator), self.obs_len, self.codec.pad_id)
        observation = jax.tree.map(lambda a, b: jnp.where(reply == WRONG_VALUE, a, b), wrong, text)
        return new_state, observation, best - state.best_score, reply == INVALID

    def process_reward(self, old_state: CountdownState, new_state: CountdownState,
                       params) -> jax.Array:
        """Improvement of the best closeness to the target (see the module docstring)."""
        del params
        return (new_state.best_closeness - old_state.best_closeness).astype(jnp.float32)

    # --------------------------------------------------------------- teachers
    def _answer(self, tokens, length) -> TokenChunk:
        def const(ids):
            return TokenChunk(jnp.asarray(ids, jnp.int32), jnp.asarray(len(ids), jnp.int32))
        return chunks.concat_all(
            [const(self._open_ids), TokenChunk(tokens, length), const(self._close_ids),
             const([self.codec.eot_id])], self.action_len, self.codec.pad_id)

    def greedy_expression(self, key, state: CountdownState) -> TokenChunk:
        """Left to right over the numbers in a random order, each operator chosen to bring
        the running value closest to the target (a greedy player without search)."""
        size, n = self.max_numbers, state.num_numbers
        index = jnp.arange(size)
        order = jnp.argsort(jnp.where(index < n, jax.random.uniform(key, (size,)), 2.0))
        numbers = state.numbers[order]
        num, den = numbers[0], jnp.ones((), jnp.int32)
        operators = []
        for i in range(1, size):
            candidates = [arithmetic.apply_rational(num, den, op, numbers[i], jnp.ones((), jnp.int32))
                          for op in range(len(OPERATORS))]
            cand_num = jnp.stack([c[0] for c in candidates])
            cand_den = jnp.stack([c[1] for c in candidates])
            safe_den = jnp.where(cand_den == 0, 1, cand_den).astype(jnp.float32)
            miss = jnp.abs(cand_num.astype(jnp.float32) / safe_den - state.target)
            operator = jnp.argmin(jnp.where(cand_den == 0, jnp.inf, miss)).astype(jnp.int32)
            live = i < n
            num = jnp.where(live, cand_num[operator], num)
            den = jnp.where(live, cand_den[operator], den)
            operators.append(operator)
        return self.expression_chunk(numbers, n, jnp.zeros((size - 1,), jnp.int32),
                                     jnp.stack(operators))

    def oracle_action(self, key, state: CountdownState, params) -> TokenChunk:
        """The generating expression (correct on the first turn)."""
        del key, params
        return self._answer(state.solution, state.solution_len)

    def demonstrator_action(self, key, state: CountdownState, params) -> TokenChunk:
        """A weaker teacher: `greedy_expression` in a fresh random order every turn."""
        del params
        expression = self.greedy_expression(key, state)
        return self._answer(expression.tokens, expression.length)

"""Arithmetic on token ids inside `jit`, shared by the arithmetic tasks: int32 operations
with an overflow check (`calculator`'s tool), exact rationals (`countdown`'s values), and
a parser that evaluates a whole expression in one `lax.scan` (`countdown`'s answers).

Expressions use Python's grammar for these tokens: non-negative integer literals,
+ − * / with standard precedence (* / bind tighter than + −) and left associativity,
parentheses, and spaces (the codec's one-token " ") anywhere except inside a number; no
unary minus, no "**" or "//", no leading zeros ("07" is malformed, "0" and "00" are
not). `ExpressionParser` keeps a two-level accumulator per parenthesis depth (sum so far,
term so far) instead of an operator stack.

Division is exact: values are rationals (int32 numerator and denominator, reduced by
Euclid's algorithm at the end), so 7/2*2 = 7 and 1/3+2/3 = 1 are exact, and a division
by zero makes the value undefined (never NaN, never a crash). Bounding the numerator and
denominator is the caller's part (`countdown` bounds its numbers so that legal
expressions never overflow int32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.envs.base import tree_select
from arl.text.codec import Codec

OPERATORS = "+-*/"
ADD, SUB, MUL, DIV = range(4)
INTEGER_RESULT_LIMIT = 2e9  # |apply_integer's result| must stay below this to fit int32
MAX_LITERAL_DIGITS = 9  # longer literals cannot be a given number (and would overflow)
GCD_STEPS = 48  # Euclid on int32 needs at most ~45 steps (Fibonacci worst case)
_NEW_TERM, _TIMES, _OVER = 0, 1, 2


def apply_integer(left: jax.Array, operator: jax.Array, right: jax.Array):
    """(result int32, overflow bool) of left OP right for OP in + - * (ADD, SUB, MUL);
    overflow when |result| >= 2e9 (checked in float32 before the int32 arithmetic is
    trusted)."""
    approx = jnp.stack([
        left.astype(jnp.float32) + right.astype(jnp.float32),
        left.astype(jnp.float32) - right.astype(jnp.float32),
        left.astype(jnp.float32) * right.astype(jnp.float32),
    ])[operator]
    overflow = jnp.abs(approx) >= INTEGER_RESULT_LIMIT
    exact = jnp.stack([left + right, left - right, left * right])[operator]
    return jnp.where(overflow, 0, exact).astype(jnp.int32), overflow


def gcd(a: jax.Array, b: jax.Array) -> jax.Array:
    """int32 gcd(|a|, |b|) by Euclid's algorithm (gcd(0, 0) = 0)."""
    def body(_, ab):
        a, b = ab
        safe = jnp.where(b == 0, 1, b)
        return jnp.where(b == 0, a, b), jnp.where(b == 0, b, a % safe)

    a, _ = jax.lax.fori_loop(0, GCD_STEPS, body, (jnp.abs(a), jnp.abs(b)))
    return a


def reduce_fraction(num: jax.Array, den: jax.Array):
    """(num, den) in lowest terms with den >= 0 (den 0 stays 0)."""
    g = jnp.maximum(gcd(num, den), 1)
    num, den = num // g, den // g
    return jnp.where(den < 0, -num, num), jnp.abs(den)


def apply_rational(a_num, a_den, operator, b_num, b_den):
    """Rational (a op b) without reduction; division by b = 0 gives denominator 0."""
    num = jnp.stack([a_num * b_den + b_num * a_den, a_num * b_den - b_num * a_den,
                     a_num * b_num, a_num * b_den])[operator]
    den = jnp.stack([a_den * b_den, a_den * b_den, a_den * b_den, a_den * b_num])[operator]
    return num, den


@struct.dataclass
class Evaluation:
    """What the in-graph parser found in an expression."""

    well_formed: jax.Array  # bool: in the grammar
    numerator: jax.Array  # int32, in lowest terms (meaningful when well formed, defined)
    denominator: jax.Array  # int32 >= 1 (0 when undefined)
    undefined: jax.Array  # bool: a division by zero
    literals: jax.Array  # int32 [L], the literals in order (-1: longer than 9 digits)
    num_literals: jax.Array  # int32


class ExpressionParser:
    """Parses and evaluates tokens[start:end] as an arithmetic expression inside `jit`
    (grammar in the module docstring). Token ids come from `codec`: digits, "+-*/()"
    (each must be one token) and " " (ignored between tokens when it is one token)."""

    def __init__(self, codec: Codec):
        self.digit_value = np.asarray(codec.digit_value, np.int32)
        self.operator_ids = np.array([codec.token_id(c) for c in OPERATORS], np.int32)
        self.open_id, self.close_id = codec.token_id("("), codec.token_id(")")
        space = codec.encode(" ")
        self.space_id = space[0] if len(space) == 1 else -1

    def __call__(self, tokens: jax.Array, start, end) -> Evaluation:
        size = tokens.shape[-1]
        depth_slots = size + 2
        zeros = jnp.zeros((depth_slots,), jnp.int32)
        ones = jnp.ones((depth_slots,), jnp.int32)
        false = jnp.zeros((), bool)
        init = dict(
            depth=jnp.zeros((), jnp.int32),
            # Per parenthesis depth: sum so far S, pending sign, term so far T, pending
            # * or / (or a new term). The level's value is S + sign * T.
            s_num=zeros, s_den=ones, sign=ones, t_num=zeros, t_den=ones,
            mulop=zeros, expect_operand=jnp.ones((), bool), in_number=false,
            number=jnp.zeros((), jnp.int32), digits=jnp.zeros((), jnp.int32),
            error=false, undefined=false,
            literals=jnp.full((size,), -1, jnp.int32), num_literals=jnp.zeros((), jnp.int32))

        def level_value(c):
            d = c["depth"]
            operator = jnp.where(c["sign"][d] > 0, ADD, SUB)
            return apply_rational(c["s_num"][d], c["s_den"][d], operator,
                                  c["t_num"][d], c["t_den"][d])

        def operand(c, v_num, v_den):
            d = c["depth"]
            mulop, t_num, t_den = c["mulop"][d], c["t_num"][d], c["t_den"][d]
            product_num, product_den = apply_rational(
                t_num, t_den, jnp.where(mulop == _OVER, DIV, MUL), v_num, v_den)
            fresh = mulop == _NEW_TERM
            return {**c,
                    "t_num": c["t_num"].at[d].set(jnp.where(fresh, v_num, product_num)),
                    "t_den": c["t_den"].at[d].set(jnp.where(fresh, v_den, product_den)),
                    "mulop": c["mulop"].at[d].set(_NEW_TERM),
                    "undefined": c["undefined"] | ((mulop == _OVER) & (v_num == 0)),
                    "expect_operand": false}

        def finalize(c):
            """Close a number being read: it becomes an operand and a literal."""
            pushed = operand(c, c["number"], jnp.ones((), jnp.int32))
            literal = jnp.where(c["digits"] > MAX_LITERAL_DIGITS, -1, c["number"])
            index = jnp.minimum(c["num_literals"], size - 1)
            pushed = {**pushed, "in_number": false,
                      "literals": c["literals"].at[index].set(literal),
                      "num_literals": c["num_literals"] + 1}
            return tree_select(c["in_number"], pushed, c)

        def step(c, inputs):
            token, active = inputs
            vocab = len(self.digit_value)
            digit = jnp.take(jnp.asarray(self.digit_value), jnp.clip(token, 0, vocab - 1))
            is_digit = (token >= 0) & (token < vocab) & (digit >= 0)
            operator = jnp.argmax(jnp.asarray(self.operator_ids) == token)
            is_operator = jnp.any(jnp.asarray(self.operator_ids) == token)
            is_open, is_close = token == self.open_id, token == self.close_id
            is_space = token == self.space_id
            f = finalize(c)
            d = f["depth"]

            # A digit starts a number where an operand is expected, or extends one.
            extended = {**c, "number": jnp.where(c["digits"] < MAX_LITERAL_DIGITS,
                                                 c["number"] * 10 + digit, c["number"]),
                        "digits": c["digits"] + 1,
                        "error": c["error"] | ((c["number"] == 0) & (digit != 0))}
            started = {**c, "in_number": jnp.ones((), bool), "number": digit,
                       "digits": jnp.ones((), jnp.int32), "expect_operand": false,
                       "error": c["error"] | ~c["expect_operand"]}
            on_digit = tree_select(c["in_number"], extended, started)

            s_num, s_den = level_value(f)
            additive = {**f, "s_num": f["s_num"].at[d].set(s_num),
                        "s_den": f["s_den"].at[d].set(s_den),
                        "sign": f["sign"].at[d].set(jnp.where(operator == SUB, -1, 1)),
                        "mulop": f["mulop"].at[d].set(_NEW_TERM),
                        "expect_operand": jnp.ones((), bool),
                        "error": f["error"] | f["expect_operand"]}
            multiplicative = {**f, "mulop": f["mulop"].at[d].set(
                                  jnp.where(operator == DIV, _OVER, _TIMES)),
                              "expect_operand": jnp.ones((), bool),
                              "error": f["error"] | f["expect_operand"]}
            on_operator = tree_select(operator >= MUL, multiplicative, additive)

            inner = jnp.minimum(c["depth"] + 1, depth_slots - 1)
            opened = {**c, "depth": inner,
                      "s_num": c["s_num"].at[inner].set(0), "s_den": c["s_den"].at[inner].set(1),
                      "sign": c["sign"].at[inner].set(1), "t_num": c["t_num"].at[inner].set(0),
                      "t_den": c["t_den"].at[inner].set(1),
                      "mulop": c["mulop"].at[inner].set(_NEW_TERM),
                      "error": c["error"] | ~c["expect_operand"]}

            v_num, v_den = level_value(f)
            closed = operand({**f, "depth": jnp.maximum(d - 1, 0)}, v_num, v_den)
            closed = {**closed, "error": f["error"] | f["expect_operand"] | (d == 0)}

            other = {**c, "error": jnp.ones((), bool)}
            new = tree_select(is_digit, on_digit, tree_select(
                is_space, f, tree_select(is_operator, on_operator, tree_select(
                    is_open, opened, tree_select(is_close, closed, other)))))
            return tree_select(active, new, c), None

        pos = jnp.arange(size)
        active = (pos >= start) & (pos < end)
        final, _ = jax.lax.scan(step, init, (tokens, active))
        final = finalize(final)
        num, den = level_value({**final, "depth": jnp.zeros((), jnp.int32)})
        well_formed = ~final["error"] & ~final["expect_operand"] & (final["depth"] == 0)
        num, den = reduce_fraction(num, den)
        undefined = final["undefined"] | (den == 0)
        return Evaluation(well_formed=well_formed, numerator=num.astype(jnp.int32),
                          denominator=den.astype(jnp.int32), undefined=undefined,
                          literals=final["literals"], num_literals=final["num_literals"])

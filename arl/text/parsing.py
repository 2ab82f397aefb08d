"""Jittable parsing of token-id arrays (one agent turn) with a valid length.

Every function takes `ids` int32 [L] and works on the valid prefix (or a
[start, end) range of it); L is static, everything else may be traced. Nothing
raises or returns NaN on garbage: "not found" is -1 and failures come back as an
`ok` flag, so a malformed turn becomes a format penalty, never an exception.
Patterns (tags) are static sequences of ids, e.g. `codec.encode("<calc>")`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_INT_DIGITS = 9  # 10**9 - 1 still fits in int32


def sanitize(ids: jax.Array, length: jax.Array, vocab_size: int, pad_id: int):
    """Clip `length` to [0, L]; replace ids past the length or outside the vocabulary
    by `pad_id` (agents, and fuzzers, can emit anything)."""
    ids = jnp.asarray(ids, jnp.int32)
    size = ids.shape[-1]
    length = jnp.clip(jnp.asarray(length, jnp.int32), 0, size)
    pos = jnp.arange(size)
    keep = (pos < length) & (ids >= 0) & (ids < vocab_size)
    return jnp.where(keep, ids, pad_id), length


def find_token(ids: jax.Array, length: jax.Array, token_id, start=0) -> jax.Array:
    """Index of the first `token_id` in [start, length), or -1."""
    pos = jnp.arange(ids.shape[-1])
    hit = (ids == token_id) & (pos >= start) & (pos < length)
    return jnp.where(jnp.any(hit), jnp.argmax(hit), -1).astype(jnp.int32)


def turn_content_length(ids: jax.Array, length: jax.Array, stop_ids) -> jax.Array:
    """Number of tokens before the first stop token (`stop_ids`: the end-of-turn id, or a
    sequence of ids that each end a turn), the whole length if none."""
    stop = jnp.atleast_1d(jnp.asarray(stop_ids, jnp.int32))
    pos = jnp.arange(ids.shape[-1])
    hit = jnp.any(ids[:, None] == stop[None, :], axis=-1) & (pos < length)
    return jnp.where(jnp.any(hit), jnp.argmax(hit), length).astype(jnp.int32)


def strip_eot(ids: jax.Array, length: jax.Array, eot_id: int) -> jax.Array:
    """`length` minus one if the last valid token is `eot_id` (the trailing eot)."""
    last = jnp.take(ids, jnp.clip(length - 1, 0, ids.shape[-1] - 1))
    return jnp.where((length > 0) & (last == eot_id), length - 1, length).astype(jnp.int32)


def _windows(ids: jax.Array, width: int) -> jax.Array:
    """[L, width] matrix whose row i is ids[i:i+width] (-1 past the end)."""
    size = ids.shape[-1]
    idx = jnp.arange(size)[:, None] + jnp.arange(width)[None, :]
    return jnp.where(idx < size, jnp.take(ids, jnp.clip(idx, 0, size - 1)), -1)


def find_subsequence(ids: jax.Array, length: jax.Array, pattern: Sequence[int],
                     start=0) -> jax.Array:
    """Index i >= start of the first occurrence of `pattern` inside ids[:length], or -1."""
    pattern = np.asarray(pattern, np.int32)
    width = int(pattern.shape[0])
    if width == 0:
        raise ValueError("pattern must be non-empty")
    pos = jnp.arange(ids.shape[-1])
    match = jnp.all(_windows(ids, width) == pattern[None, :], axis=1)
    match = match & (pos >= start) & (pos + width <= length)
    return jnp.where(jnp.any(match), jnp.argmax(match), -1).astype(jnp.int32)


def range_equals(ids: jax.Array, start, end, pattern: Sequence[int]) -> jax.Array:
    """True iff ids[start:end] == pattern exactly."""
    pattern = np.asarray(pattern, np.int32)
    width = int(pattern.shape[0])
    size = ids.shape[-1]
    if width == 0:
        return jnp.asarray(end - start == 0)
    idx = jnp.asarray(start) + jnp.arange(width)
    window = jnp.where(idx < size, jnp.take(ids, jnp.clip(idx, 0, size - 1)), -1)
    return (end - start == width) & (start >= 0) & jnp.all(window == pattern)


def equals(ids: jax.Array, length: jax.Array, pattern: Sequence[int]) -> jax.Array:
    """True iff ids[:length] == pattern exactly."""
    return range_equals(ids, 0, length, pattern)


def starts_with(ids: jax.Array, length: jax.Array, pattern: Sequence[int]) -> jax.Array:
    width = len(pattern)
    return (length >= width) & range_equals(ids, 0, width, pattern)


def ends_with(ids: jax.Array, length: jax.Array, pattern: Sequence[int]) -> jax.Array:
    width = len(pattern)
    return (length >= width) & range_equals(ids, length - width, length, pattern)


def parse_int(ids: jax.Array, start, end, digit_value: np.ndarray, minus_id: int,
              max_digits: int = MAX_INT_DIGITS) -> tuple[jax.Array, jax.Array]:
    """Parse ids[start:end] as a decimal integer with an optional leading minus.

    Returns (value int32, ok bool). ok is False for an empty range, a lone minus, any
    non-digit, or more than `max_digits` digits (value is then 0). Leading zeros are
    accepted ("007" -> 7), as Python's int() does.
    """
    if not 1 <= max_digits <= MAX_INT_DIGITS:
        raise ValueError(f"max_digits must be in [1, {MAX_INT_DIGITS}], got {max_digits}")
    size = ids.shape[-1]
    start = jnp.asarray(start, jnp.int32)
    end = jnp.asarray(end, jnp.int32)
    pos = jnp.arange(size)
    first = jnp.take(ids, jnp.clip(start, 0, size - 1))
    negative = (end > start) & (first == minus_id)
    digits_start = start + negative.astype(jnp.int32)
    num_digits = end - digits_start
    region = (pos >= digits_start) & (pos < end)
    values = jnp.take(jnp.asarray(digit_value), jnp.clip(ids, 0, len(digit_value) - 1))
    values = jnp.where((ids >= 0) & (ids < len(digit_value)), values, -1)
    ok = (
        (start >= 0)
        & (end <= size)
        & (num_digits >= 1)
        & (num_digits <= max_digits)
        & jnp.all(jnp.where(region, values >= 0, True))
    )
    powers = jnp.asarray(10 ** np.arange(max_digits), jnp.int32)
    exponent = jnp.clip(end - 1 - pos, 0, max_digits - 1)
    magnitude = jnp.sum(jnp.where(region & ok, values * powers[exponent], 0))
    value = jnp.where(negative, -magnitude, magnitude)
    return jnp.where(ok, value, 0).astype(jnp.int32), ok


def split_args(ids: jax.Array, start, end, sep_id: int, max_args: int):
    """Split ids[start:end] at every `sep_id` (like Python's str.split(sep)).

    Returns (starts int32 [max_args], ends int32 [max_args], num_args int32 []):
    argument k is ids[starts[k]:ends[k]] for k < min(num_args, max_args). num_args is
    the TRUE count (separators + 1), so callers detect too many arguments by
    num_args > max_args.
    """
    size = ids.shape[-1]
    pos = jnp.arange(size)
    start = jnp.asarray(start, jnp.int32)
    end = jnp.asarray(end, jnp.int32)
    is_sep = (ids == sep_id) & (pos >= start) & (pos < end)
    seps = jnp.nonzero(is_sep, size=max_args, fill_value=end)[0].astype(jnp.int32)
    seps = jnp.minimum(seps, end)
    starts = jnp.concatenate([start[None], seps[:-1] + 1])
    starts = jnp.minimum(starts, end)
    num_args = jnp.sum(is_sep).astype(jnp.int32) + 1
    return starts, seps, num_args

"""Padded chunks of token ids (`TokenChunk`, what token environments observe and act
with) and building them inside `jit`: constants, concatenation, integers.

All outputs are `TokenChunk`s of a static size, padded with the codec's pad id.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.text.codec import Codec


@struct.dataclass
class TokenChunk:
    """One padded chunk of token ids: `tokens` int32 [L] (pad_id-padded), `length` int32 []
    (number of valid tokens, a prefix)."""

    tokens: jax.Array
    length: jax.Array


def constant_chunk(codec: Codec, text: str, size: int) -> TokenChunk:
    tokens, length = codec.encode_padded(text, size)
    return TokenChunk(tokens=jnp.asarray(tokens), length=jnp.asarray(length, jnp.int32))


def select_text(codec: Codec, index: jax.Array, texts: Sequence[str], size: int) -> TokenChunk:
    """The chunk of texts[index] (index traced), padded to `size`."""
    return select_ids(codec, index, [codec.encode(t) for t in texts], size)


def with_eot(codec: Codec, text: str) -> list[int]:
    """The ids of `text` then the codec's end-of-turn id: an agent turn as the scripted
    policies write it (any codec; "<eot>" spelled in text is CharCodec's name only)."""
    return codec.encode(text) + [codec.eot_id]


def select_ids(codec: Codec, index: jax.Array, id_lists: Sequence[Sequence[int]],
               size: int) -> TokenChunk:
    """The chunk of id_lists[index] (index traced), padded to `size`."""
    table = np.full((len(id_lists), size), codec.pad_id, np.int32)
    for row, ids in enumerate(id_lists):
        if len(ids) > size:
            raise ValueError(f"{codec.decode(ids, stop_at_pad=False)!r} needs {len(ids)} "
                             f"tokens, more than length={size}")
        table[row, :len(ids)] = ids
    lengths = jnp.asarray(np.array([len(ids) for ids in id_lists], np.int32))
    index = jnp.clip(index, 0, len(id_lists) - 1)
    return TokenChunk(tokens=jnp.asarray(table)[index], length=lengths[index])


def pad_chunk(chunk: TokenChunk, size: int, pad_id: int) -> TokenChunk:
    """Pad (or cut) `chunk` to static `size`."""
    current = chunk.tokens.shape[-1]
    if size >= current:
        tokens = jnp.concatenate(
            [chunk.tokens, jnp.full((size - current,), pad_id, chunk.tokens.dtype)]
        )
    else:
        tokens = chunk.tokens[:size]
    return TokenChunk(tokens=tokens, length=jnp.minimum(chunk.length, size).astype(jnp.int32))


def concat_chunks(first: TokenChunk, second: TokenChunk, size: int, pad_id: int) -> TokenChunk:
    """first[:first.length] + second[:second.length], cut to `size`, padded."""
    pos = jnp.arange(size)
    n_first = first.tokens.shape[-1]
    n_second = second.tokens.shape[-1]
    from_first = jnp.take(first.tokens, jnp.clip(pos, 0, n_first - 1))
    second_pos = pos - first.length
    from_second = jnp.take(second.tokens, jnp.clip(second_pos, 0, n_second - 1))
    tokens = jnp.where(pos < first.length, from_first, from_second)
    length = jnp.minimum(first.length + second.length, size).astype(jnp.int32)
    tokens = jnp.where(pos < length, tokens, pad_id)
    return TokenChunk(tokens=tokens.astype(jnp.int32), length=length)


def concat_all(chunks: Sequence[TokenChunk], size: int, pad_id: int) -> TokenChunk:
    out = pad_chunk(chunks[0], size, pad_id)
    for chunk in chunks[1:]:
        out = concat_chunks(out, chunk, size, pad_id)
    return out


def _digit_tokens(codec: Codec, magnitude: jax.Array, num_digits: jax.Array,
                  max_digits: int, offset) -> tuple[jax.Array, jax.Array]:
    """(ids [max_digits + offset], count): the `num_digits` decimal digits of `magnitude`
    (leading zeros where num_digits is wider) as the codec writes them, runs of
    `codec.digit_group` digits from the left, starting at position `offset`."""
    group = int(codec.digit_group)
    size = max_digits + 1
    pos = jnp.arange(size) - offset
    first = pos * group  # index of the token's first digit, from the left
    width = jnp.clip(num_digits - first, 1, group)
    powers = jnp.asarray(10 ** np.arange(max_digits, dtype=np.int64), jnp.int32)
    shift = jnp.clip(num_digits - first - width, 0, max_digits - 1)
    piece = (magnitude // powers[shift]) % jnp.asarray([10, 100, 1000], jnp.int32)[width - 1]
    ids = jnp.asarray(codec.digit_group_ids)[width - 1, jnp.clip(piece, 0, 10 ** group - 1)]
    count = (num_digits + group - 1) // group
    return ids, count.astype(jnp.int32)


def int_chunk(codec: Codec, value: jax.Array, max_digits: int = 10) -> TokenChunk:
    """Decimal text of int32 `value` ("-" then digits, no leading zeros) in the codec's
    ids (a subword codec may merge digits: `Codec.digit_group`), size max_digits + 1.
    |value| must have at most `max_digits` digits (10 covers int32)."""
    if not 1 <= max_digits <= 10:
        raise ValueError(f"max_digits must be in [1, 10], got {max_digits}")
    size = max_digits + 1
    value = jnp.asarray(value, jnp.int32)
    negative = value < 0
    magnitude = jnp.abs(value)
    powers = jnp.asarray(10 ** np.arange(max_digits, dtype=np.int64), jnp.int32)
    num_digits = 1 + jnp.sum(magnitude >= powers[1:]).astype(jnp.int32)
    sign = negative.astype(jnp.int32)
    digit_ids, count = _digit_tokens(codec, magnitude, num_digits, max_digits, sign)
    pos = jnp.arange(size)
    tokens = jnp.where(negative & (pos == 0), codec.token_id("-"), digit_ids)
    length = count + sign
    tokens = jnp.where(pos < length, tokens, codec.pad_id)
    return TokenChunk(tokens=tokens.astype(jnp.int32), length=length.astype(jnp.int32))


def digits_chunk(codec: Codec, value: jax.Array, num_digits: int) -> TokenChunk:
    """The `num_digits` last decimal digits of int32 `value` >= 0, leading zeros kept
    ("05"), in the codec's ids; size num_digits."""
    if not 1 <= num_digits <= 9:
        raise ValueError(f"num_digits must be in [1, 9], got {num_digits}")
    value = jnp.asarray(value, jnp.int32) % (10 ** num_digits)
    ids, count = _digit_tokens(codec, value, jnp.asarray(num_digits, jnp.int32),
                               num_digits, 0)
    tokens = jnp.where(jnp.arange(num_digits + 1) < count, ids, codec.pad_id)[:num_digits]
    return TokenChunk(tokens=tokens.astype(jnp.int32), length=count)

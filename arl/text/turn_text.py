"""The agent's turn as text, inside `jit`: every token env parses characters, not ids.

A tokenizer spells the same text with different ids: Qwen splits numbers into digits,
Llama 3 merges up to three digits into one token ("115" is one id), byte-level BPEs
merge letters and spaces. An env that matched ids would answer "invalid" to a number the
policy wrote as the tokenizer writes it. So an env reads the agent's turn through
`TurnReader`: each id becomes the characters it decodes to (`verifiers.char_table`, one
table built at construction), giving a `TokenChunk` of Unicode code points, and parses
that with the id-level functions of `arl.text.parsing`, whose patterns are then code
points (`text_ids`) and whose digit table is `DIGIT_VALUE`. The same turn therefore means
the same thing under every codec, however the policy split it into tokens.
"""

from __future__ import annotations

import string

import jax.numpy as jnp
import numpy as np

from arl.text import parsing, verifiers
from arl.text.chunks import TokenChunk
from arl.text.codec import Codec, codec_cache

# Digit value of every ASCII code point (-1: not a digit); `parsing.parse_int` reads
# code points past the table as non-digits.
DIGIT_VALUE = np.full((128,), -1, np.int32)
DIGIT_VALUE[[ord(d) for d in string.digits]] = np.arange(10, dtype=np.int32)


def text_ids(text: str) -> list[int]:
    """The code points of `text`: a pattern for `arl.text.parsing` on a read turn."""
    return [ord(char) for char in text]


def text_id(char: str) -> int:
    if len(char) != 1:
        raise ValueError(f"char must be one character, got {char!r}")
    return ord(char)


class CodePoints:
    """The pattern side of a read turn, shaped like a `Codec` for parsers built from one
    (`arl.envs.tasks.arithmetic.ExpressionParser`): ids are code points."""

    digit_value = DIGIT_VALUE

    @staticmethod
    def encode(text: str) -> list[int]:
        return text_ids(text)

    @staticmethod
    def token_id(char: str) -> int:
        return text_id(char)


CODE_POINTS = CodePoints()


class TurnReader:
    """Reads an agent turn (ids) as code points (module docstring).

    Args:
      codec: the codec of the ids.
      max_token_chars: an id whose text is longer reads as one U+FFFD character (never
        a digit, letter or punctuation mark, so it cannot complete a parse by accident).
    """

    def __init__(self, codec: Codec, max_token_chars: int = 16):
        cache = codec_cache(codec, "_char_tables")
        if max_token_chars not in cache:
            cache[max_token_chars] = verifiers.char_table(codec, max_token_chars)
        self.codec = codec
        self._table, self._counts = cache[max_token_chars]

    def width(self, num_tokens: int) -> int:
        """Static width of the text of `num_tokens` ids."""
        return num_tokens * self._table.shape[-1]

    def __call__(self, content: TokenChunk) -> TokenChunk:
        """The code points of content.tokens[:content.length], [width(L)], FILL (-1)
        padded, and their number."""
        tokens, length = parsing.sanitize(content.tokens, content.length,
                                          self.codec.vocab_size, self.codec.pad_id)
        chars, count = verifiers.token_chars(jnp.asarray(self._table),
                                             jnp.asarray(self._counts), tokens, length)
        return TokenChunk(chars.astype(jnp.int32), count.astype(jnp.int32))

"""CharCodec round trips and the jittable parsing / chunk helpers against Python."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arl.text import chunks, parsing
from arl.envs.base import TokenChunk
from arl.text.codec import CHARACTERS, SPECIAL_TOKENS, CharCodec

CODEC = CharCodec()
SIZE = 16
MINUS = CODEC.token_id("-")
SETTINGS = settings(max_examples=80, deadline=None)

text_of_chars = st.text(alphabet=CHARACTERS, max_size=SIZE)
short_numberish = st.text(alphabet="0123456789-+*a", max_size=SIZE)


def as_ids(text):
    ids, length = CODEC.encode_padded(text, SIZE)
    return jnp.asarray(ids), jnp.asarray(length, jnp.int32)


def test_vocabulary_layout():
    assert CODEC.pad_id == 0
    assert CODEC.vocab_size == len(SPECIAL_TOKENS) + len(CHARACTERS) < 128
    assert len(set([CODEC.pad_id, CODEC.bos_id, CODEC.eot_id])) == 3
    for ch in "<>/+-*=()\n ":
        assert CODEC.decode(CODEC.encode(ch)) == ch
    assert [CODEC.decode([d]) for d in CODEC.digit_ids] == list("0123456789")
    assert CODEC.digit_value[CODEC.token_id("7")] == 7
    assert CODEC.digit_value[CODEC.token_id("a")] == -1


def test_special_tokens_and_errors():
    ids = CODEC.encode("<bos>12<eot>")
    assert ids[0] == CODEC.bos_id and ids[-1] == CODEC.eot_id and len(ids) == 4
    assert CODEC.decode(ids, show_special=False) == "12"
    # "<" not starting a special token is an ordinary character.
    assert CODEC.decode(CODEC.encode("<calc>")) == "<calc>"
    with pytest.raises(ValueError, match="not in the CharCodec vocabulary"):
        CODEC.encode("é")
    assert CODEC.decode([5, 999, -3]) == "0<?><?>"
    with pytest.raises(ValueError, match="length=2"):
        CODEC.encode_padded("abc", 2)


@given(text_of_chars)
@SETTINGS
def test_codec_round_trip(text):
    assert CODEC.decode(CODEC.encode(text)) == text
    ids, n = CODEC.encode_padded(text, SIZE)
    # One id per character, except a special-token spelling (e.g. "<user>", which
    # hypothesis can draw from the characters), which is one id.
    assert n == len(CODEC.encode(text)) <= len(text) and (ids[n:] == CODEC.pad_id).all()
    assert CODEC.decode(ids) == text


def test_special_token_spelled_in_text_is_one_id():
    assert CODEC.encode("a<user>b") == [CODEC.encode("a")[0], CODEC.user_id,
                                        CODEC.encode("b")[0]]
    assert CODEC.encode_padded("<user>", SIZE)[1] == 1


_find = jax.jit(parsing.find_subsequence, static_argnums=2)


@given(text_of_chars, st.sampled_from(["<calc>", "</calc>", "a", "ab", "12", "-"]),
       st.integers(0, SIZE))
@SETTINGS
def test_find_subsequence_matches_str_find(text, pattern, start):
    ids, length = as_ids(text)
    got = int(_find(ids, length, tuple(CODEC.encode(pattern)), start))
    assert got == text.find(pattern, start) if start <= len(text) else got == -1


_parse_int = jax.jit(
    lambda ids, s, e: parsing.parse_int(ids, s, e, CODEC.digit_value, MINUS))


def python_parse_int(text):
    body = text[1:] if text.startswith("-") else text
    if not body or not body.isdigit() or len(body) > parsing.MAX_INT_DIGITS:
        return 0, False
    return int(text), True


@given(short_numberish, st.integers(0, SIZE), st.integers(0, SIZE))
@SETTINGS
def test_parse_int_matches_python(text, start, end):
    ids, _ = as_ids(text)
    start, end = min(start, end, len(text)), min(max(start, end), len(text))
    value, ok = _parse_int(ids, start, end)
    assert (int(value), bool(ok)) == python_parse_int(text[start:end])


def test_parse_int_hand_cases():
    for text, expected in [("0", (0, True)), ("-0", (0, True)), ("007", (7, True)),
                           ("-45", (-45, True)), ("-", (0, False)), ("", (0, False)),
                           ("1-2", (0, False)), ("123456789", (123456789, True)),
                           ("1234567890", (0, False)), ("--1", (0, False))]:
        ids, length = as_ids(text)
        value, ok = _parse_int(ids, 0, length)
        assert (int(value), bool(ok)) == expected, text


_split = jax.jit(lambda ids, s, e: parsing.split_args(ids, s, e, CODEC.token_id(","), 4))


@given(st.text(alphabet="ab1,", max_size=SIZE))
@SETTINGS
def test_split_args_matches_str_split(text):
    ids, length = as_ids(text)
    starts, ends, count = _split(ids, 0, length)
    expected = text.split(",")
    assert int(count) == len(expected)
    for k in range(min(len(expected), 4)):
        assert text[int(starts[k]):int(ends[k])] == expected[k]


@given(st.text(alphabet="ab1", max_size=6), st.booleans(), st.text(alphabet="ab", max_size=4))
@SETTINGS
def test_eot_helpers(body, with_eot, after):
    text = body + ("<eot>" + after if with_eot else "")
    ids, length = as_ids(text)
    assert int(parsing.turn_content_length(ids, length, CODEC.eot_id)) == len(body)
    stripped = int(parsing.strip_eot(ids, length, CODEC.eot_id))
    trailing = with_eot and after == ""
    assert stripped == int(length) - (1 if trailing else 0)


def test_sanitize_replaces_garbage():
    ids = jnp.array([5, -4, 200, 6, 7], jnp.int32)
    clean, length = parsing.sanitize(ids, jnp.asarray(4), CODEC.vocab_size, CODEC.pad_id)
    np.testing.assert_array_equal(clean, [5, 0, 0, 6, 0])
    assert int(length) == 4
    _, length = parsing.sanitize(ids, jnp.asarray(-3), CODEC.vocab_size, CODEC.pad_id)
    assert int(length) == 0
    _, length = parsing.sanitize(ids, jnp.asarray(99), CODEC.vocab_size, CODEC.pad_id)
    assert int(length) == 5


def test_equals_starts_ends():
    ids, length = as_ids("<calc>1</calc>")
    assert bool(parsing.starts_with(ids, length, CODEC.encode("<calc>")))
    assert bool(parsing.ends_with(ids, length, CODEC.encode("</calc>")))
    assert not bool(parsing.equals(ids, length, CODEC.encode("<calc>")))
    assert bool(parsing.equals(ids, length, CODEC.encode("<calc>1</calc>")))


_int_chunk = jax.jit(lambda v: chunks.int_chunk(CODEC, v))


@given(st.integers(-(2**31) + 1, 2**31 - 1))
@SETTINGS
def test_int_chunk_matches_str(value):
    chunk = _int_chunk(jnp.asarray(value, jnp.int32))
    assert CODEC.decode(np.asarray(chunk.tokens)[: int(chunk.length)]) == str(value)


@given(st.text(alphabet="abc", max_size=5), st.text(alphabet="xyz", max_size=5))
@SETTINGS
def test_concat_chunks(first, second):
    a = TokenChunk(*map(jnp.asarray, CODEC.encode_padded(first, 6)))
    b = TokenChunk(*map(jnp.asarray, CODEC.encode_padded(second, 5)))
    out = chunks.concat_chunks(a, b, 8, CODEC.pad_id)
    expected = (first + second)[:8]
    assert int(out.length) == len(expected)
    assert CODEC.decode(out.tokens) == expected
    assert (np.asarray(out.tokens)[len(expected):] == CODEC.pad_id).all()

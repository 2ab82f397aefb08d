"""The in-graph answer verifiers (`arl.text.verifiers`) against their plain-Python
references, on thousands of random texts, and the references on hand-computed cases."""

import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arl.text import verifiers as V
from arl.text.codec import CharCodec

WIDTH = 40  # characters per text
BATCH = 64  # texts per hypothesis example: 40 examples x 64 = 2,560 texts per property
SETTINGS = settings(max_examples=40, deadline=None)

# Pieces that make number-like text: separators, signs, decimals, the GSM8K mark, words.
NUMBER_PIECES = ["####", "###", "#", "-", "+", ",", ".", " ", "\n", "0", "00", "7", "12",
                 "1,234", "1,2", "3.50", ".5", "5.", "-0", "0.0", "1.2.3", "x", "is ",
                 "= ", "$", "abc", "10-3", "-4.20", "1,000,000", "99", ",,", "..", "é"]
TEXT_PIECES = ["Paris", "paris", "PARIS", "New York", "new-york", "The", " ", "  ", "\t",
               "\n", "!", ".", ",", "'", "?", "a", "B", "é", "Ü", "42", "-", "_", "\x0b"]


def texts_from(pieces):
    joined = st.lists(st.sampled_from(pieces), max_size=12).map("".join)
    chars = st.text(alphabet=string.printable + "é", max_size=WIDTH)
    return st.one_of(joined, chars).map(lambda t: t[:WIDTH])


def batch_of(pieces):
    return st.lists(texts_from(pieces), min_size=BATCH, max_size=BATCH)


def as_code_points(texts):
    rows = [V.code_points(t, WIDTH) for t in texts]
    return jnp.asarray(np.stack([r[0] for r in rows])), jnp.asarray([r[1] for r in rows],
                                                                      jnp.int32)


def text_of(chars, length):
    return "".join(chr(c) for c in np.asarray(chars)[: int(length)])


_number = jax.jit(jax.vmap(V.canonical_number))
_strip = jax.jit(jax.vmap(V.strip_chars))
_normalized = jax.jit(jax.vmap(V.normalized_chars))


@given(batch_of(NUMBER_PIECES))
@SETTINGS
def test_canonical_number_matches_python(texts):
    out, length, found = _number(*as_code_points(texts))
    for i, text in enumerate(texts):
        expected = V.extract_number(text)
        assert bool(found[i]) == (expected is not None), text
        if expected is not None:
            assert text_of(out[i], length[i]) == expected, text


@given(batch_of(TEXT_PIECES))
@SETTINGS
def test_strip_and_normalize_match_python(texts):
    chars, lengths = as_code_points(texts)
    stripped, n_stripped, ok_stripped = _strip(chars, lengths)
    normal, n_normal, ok_normal = _normalized(chars, lengths)
    for i, text in enumerate(texts):
        assert text_of(stripped[i], n_stripped[i]) == V.strip_text(text), repr(text)
        assert bool(ok_stripped[i]) == bool(V.strip_text(text))
        assert text_of(normal[i], n_normal[i]) == V.normalize_text(text), repr(text)
        assert bool(ok_normal[i]) == bool(V.normalize_text(text))
        # Padding past the length is FILL, so equal texts compare equal as arrays.
        assert np.all(np.asarray(normal[i])[int(n_normal[i]):] == V.FILL)


@pytest.mark.parametrize("text, expected", [
    ("19", "19"), ("The answer is 19.", "19"), ("1,234", "1234"), ("-1,234.500", "-1234.5"),
    ("007", "7"), ("3.0", "3"), ("0.50", "0.5"), (".5", "0.5"), ("5.", "5"), ("-0", "0"),
    ("-0.000", "0"), ("x = -3", "-3"), ("10-3", "3"), ("pages 2-5", "5"), ("+5", "5"),
    ("2 then 3 then 4", "4"), ("#### 72", "72"), ("so #### 72 apples, not 80", "72"),
    ("12 #### -8 and 9", "-8"), ("####-8", "-8"), ("7 ####", None), ("1.2.3", None),
    ("no digits", None), ("", None), ("1,2", "12"), ("42, and", "42"), ("#####5", "5"),
    ("1e5", "5"), ("3 - 4", "4"), ("--5", "-5"), ("1.-5", "-5"),
])
def test_extract_number_hand_cases(text, expected):
    assert V.extract_number(text) == expected
    out, length, found = _number(*as_code_points([text] * BATCH))
    assert bool(found[0]) == (expected is not None)
    if expected is not None:
        assert text_of(out[0], length[0]) == expected


def test_string_forms_hand_cases():
    assert V.strip_text(" \tParis\n") == "Paris"
    assert V.normalize_text("  New-York!") == "newyork"
    assert V.normalize_text("The  Eiffel\nTower.") == "the eiffel tower"
    assert V.normalize_text("Ünïcode KEPT") == "Ünïcode kept"  # ASCII lower-casing only
    assert V.normalize_text(" ?! ") == ""


def test_equal_texts_widths_and_lengths():
    a, na = V.code_points("12", 5)
    b, nb = V.code_points("12", 3)
    c, nc = V.code_points("123", 3)
    eq = jax.jit(V.equal_texts)
    assert bool(eq(a, na, b, nb)) and not bool(eq(a, na, c, nc))
    assert not bool(eq(a, jnp.asarray(-1), b, jnp.asarray(-1)))  # "no number" never matches


def test_char_table_of_char_codec_reads_text_and_marks_specials():
    codec = CharCodec()
    table, counts = V.char_table(codec)
    assert table.shape == (codec.vocab_size, 1) and np.all(counts == 1)
    text = "Tom has 1,234.5 #### -7?"
    ids = jnp.asarray(codec.encode(text + "<eot>x"))
    chars, n = V.token_chars(jnp.asarray(table), jnp.asarray(counts), ids, len(text) + 1)
    assert text_of(chars, n - 1) == text and int(chars[len(text)]) == V.REPLACEMENT
    assert np.all(np.asarray(chars)[int(n):] == V.FILL)


@pytest.fixture(scope="module")
def bpe_codec():
    from configs.tokenizer_corpus import env_corpus
    from arl.text.hf_codec import HFCodec, train_bpe_tokenizer

    corpus = env_corpus() + ["Tom has 12 apples and buys 7 more. How many apples?",
                             "the answer is #### 1,234.5 and New York"] * 3
    return HFCodec(train_bpe_tokenizer(corpus, vocab_size=320))


# "<" starts the codec's special markers (<system>, <eot>, ...): ids, not text.
@given(st.lists(texts_from(NUMBER_PIECES + TEXT_PIECES).filter(
    lambda t: "é" not in t and "Ü" not in t and "<" not in t), min_size=8, max_size=8))
@settings(max_examples=25, deadline=None)
def test_subword_ids_read_back_as_their_text(bpe_codec, texts):
    """Multi-character ids are expanded (with their spaces) into the text they encode, so
    the verifiers see the same characters whatever the codec."""
    table, counts = (jnp.asarray(x) for x in V.char_table(bpe_codec))
    assert table.shape[1] > 1
    expand = jax.jit(V.token_chars)
    for text in texts:
        ids, n = bpe_codec.encode_padded(text, 3 * WIDTH)
        chars, num_chars = expand(table, counts, jnp.asarray(ids), jnp.asarray(n))
        assert text_of(chars, num_chars) == bpe_codec.decode(ids[:n]) == text

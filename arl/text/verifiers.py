"""Checking an agent's answer against a reference inside `jit`, on characters.

An agent turn is token ids; the verifiers read it as Unicode code points, through a
per-id table built once from the codec (`char_table`): a `CharCodec` id is one
character, a subword id (`HFCodec`) the characters it decodes to. So one implementation
serves every codec, and the reference answers are stored codec-free, as code points.

Three answer forms, each with a plain-Python reference (used to write datasets, and by
the tests as the specification of the jittable code) and a jittable twin:

* **number** (`extract_number` / `canonical_number`), the GSM8K convention
  (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems": solutions end in
  "#### <answer>"). Which number: if the text contains "####", the FIRST number after
  the first "####" (nothing before it counts); otherwise the LAST number of the text.
  A number is a maximal run of the characters ``0-9 , .`` that holds at least one digit,
  cut after its last digit (so "42." and "42," read 42, and ".5" reads 0.5). It is
  negative when a "-" stands right before the run and the "-" does not itself follow a
  digit ("-3" and "x = -3" are -3; in "10-3" and "pages 2-5" the "-" is an operator or a
  range, so 3 and 5). Normalisation: every "," is dropped (thousands separators, wherever
  they stand: "1,2" reads 12); more than one "." is malformed (no number); leading zeros
  of the integer part and trailing zeros of the fraction are dropped, an empty integer
  part becomes "0", an empty fraction drops the "."; "-0" is "0". The canonical form is
  that text, e.g. "-1,234.500" -> "-1234.5", "007" -> "7", "3.0" -> "3". Two numbers are
  equal when their canonical texts are (exact decimal comparison, no float rounding, any
  number of digits). A "+" sign is an ordinary character ("+5" reads 5).
* **exact** (`strip_text` / `strip_chars`): the text with leading and trailing ASCII
  whitespace (space, tab, newline, carriage return, vertical tab, form feed) removed.
* **normalized** (`normalize_text` / `normalized_chars`): ASCII letters lower-cased,
  every ASCII punctuation character (`string.punctuation`) removed, then runs of ASCII
  whitespace collapsed to one space and the ends stripped ("  New-York!" -> "newyork",
  "The  Eiffel\\nTower." -> "the eiffel tower"). Non-ASCII characters are kept as they
  are (no Unicode case folding), and articles are not removed (unlike SQuAD's scorer).

The jittable functions take `chars` int32 [C] (code points) and `num_chars` int32 []
and return `(form int32 [W], form_length int32 [], ok bool [])`, padded with -1; they
never raise and never index out of bounds, whatever the input.
"""

from __future__ import annotations

import re
import string

import jax
import jax.numpy as jnp
import numpy as np

from arl.text import parsing
from arl.text.codec import Codec

WHITESPACE = " \t\n\r\x0b\x0c"
PUNCTUATION = string.punctuation
REPLACEMENT = 0xFFFD  # U+FFFD, the code point of special tokens and undecodable ids
FILL = -1  # padding of code-point arrays (never a character)
ANSWER_MARK = "####"
_DIGITS = "0123456789"
_RUN = re.compile(r"[0-9.,]+")
_DIGIT = re.compile(r"[0-9]")
_WHITESPACE_RUN = re.compile(f"[{re.escape(WHITESPACE)}]+")


# ------------------------------------------------------------ plain-Python references
def extract_number(text: str) -> str | None:
    """Canonical text of the answer number of `text` (module docstring), or None."""
    mark = text.find(ANSWER_MARK)
    offset = mark + len(ANSWER_MARK) if mark >= 0 else 0
    runs = [m for m in _RUN.finditer(text, offset) if _DIGIT.search(m.group())]
    if not runs:
        return None
    run = runs[0] if mark >= 0 else runs[-1]
    start = run.start()
    body = run.group()
    body = body[: max(i for i, ch in enumerate(body) if ch in _DIGITS) + 1]
    body = body.replace(",", "")
    if body.count(".") > 1:
        return None
    integer, _, fraction = body.partition(".")
    integer = integer.lstrip("0") or "0"
    fraction = fraction.rstrip("0")
    canonical = integer + ("." + fraction if fraction else "")
    negative = (start >= 1 and text[start - 1] == "-"
                and (start < 2 or text[start - 2] not in _DIGITS))
    return "-" + canonical if negative and canonical != "0" else canonical


def strip_text(text: str) -> str:
    """`text` without leading and trailing ASCII whitespace."""
    return text.strip(WHITESPACE)


def normalize_text(text: str) -> str:
    """ASCII lower-case, ASCII punctuation removed, whitespace runs collapsed, stripped."""
    lowered = "".join(chr(ord(ch) + 32) if "A" <= ch <= "Z" else ch for ch in text)
    kept = "".join(ch for ch in lowered if ch not in PUNCTUATION)
    return " ".join(word for word in _WHITESPACE_RUN.split(kept) if word)


def code_points(text: str, width: int) -> tuple[np.ndarray, int]:
    """(int32 [width] code points of `text` padded with FILL, len(text))."""
    if len(text) > width:
        raise ValueError(f"text {text!r} has {len(text)} characters, more than width={width}")
    out = np.full((width,), FILL, np.int32)
    out[: len(text)] = [ord(ch) for ch in text]
    return out, len(text)


# ---------------------------------------------------------------- token ids -> chars
def _token_texts(codec: Codec) -> list[str | None]:
    """Text of every id (None for special tokens), as it reads inside a longer text."""
    from arl.text.hf_codec import HFCodec  # pylint: disable=g-import-not-at-top

    if isinstance(codec, HFCodec):
        tokenizer = codec.tokenizer
        # Decoded after an anchor digit: a lone-token decode drops the leading space of
        # SentencePiece-style pieces ("▁hello" -> "hello"), which would glue words.
        anchor = int(codec.digit_ids[0])
        prefix = len(tokenizer.decode([anchor], skip_special_tokens=False))
        special = codec.special_ids
        pairs = tokenizer.decode_batch([[anchor, i] for i in range(codec.vocab_size)],
                                       skip_special_tokens=False)
        return [None if i in special else text[prefix:] for i, text in enumerate(pairs)]
    texts = []
    for i in range(codec.vocab_size):
        text = codec.decode([i], stop_at_pad=False, show_special=False)
        texts.append(text if text else None)
    return texts


def char_table(codec: Codec, max_chars: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [vocab_size, K] code points, int32 [vocab_size] counts) of every id.

    K = the longest id's text, at most `max_chars`. Special tokens (pad, bos, end of
    turn, roles) and ids whose text is longer than `max_chars` read as one U+FFFD
    character: never a digit, letter, space or punctuation, so they cannot complete an
    answer by accident."""
    if not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars must be an int >= 1, got {max_chars!r}")
    texts = [t if t is None or len(t) <= max_chars else None for t in _token_texts(codec)]
    width = max([1] + [len(t) for t in texts if t])
    table = np.full((codec.vocab_size, width), FILL, np.int32)
    counts = np.ones((codec.vocab_size,), np.int32)
    for i, text in enumerate(texts):
        if text is None:
            table[i, 0] = REPLACEMENT
        else:
            table[i, : len(text)] = [ord(ch) for ch in text]
            counts[i] = len(text)
    return table, counts


def compact(values: jax.Array, keep: jax.Array, width: int):
    """(values[keep] in order, padded with FILL to [width], count); kept values past
    `width` are dropped (count still counts them)."""
    index = jnp.cumsum(keep.astype(jnp.int32)) - 1
    target = jnp.where(keep & (index < width), index, width)
    out = jnp.full((width + 1,), FILL, jnp.int32).at[target].set(values.astype(jnp.int32))
    return out[:width], jnp.sum(keep).astype(jnp.int32)


def token_chars(table: jax.Array, counts: jax.Array, tokens: jax.Array, length: jax.Array):
    """(chars int32 [L * K], num_chars int32 []) of the valid prefix of `tokens` [L]
    (ids already sanitised into [0, vocab_size))."""
    size = tokens.shape[-1]
    width = table.shape[-1]
    valid = jnp.arange(size) < length
    if width == 1:  # one character per id (CharCodec): no compaction needed
        return jnp.where(valid, table[tokens, 0], FILL), jnp.asarray(length, jnp.int32)
    keep = (jnp.arange(width)[None, :] < counts[tokens][:, None]) & valid[:, None]
    return compact(table[tokens].reshape(-1), keep.reshape(-1), size * width)


# ------------------------------------------------------------------ jittable forms
def _is_in(chars: jax.Array, alphabet: str) -> jax.Array:
    return jnp.isin(chars, jnp.asarray([ord(ch) for ch in alphabet], jnp.int32))


def _is_digit(chars: jax.Array) -> jax.Array:
    return (chars >= ord("0")) & (chars <= ord("9"))


def _first(mask: jax.Array, default) -> jax.Array:
    return jnp.where(jnp.any(mask), jnp.argmax(mask), default).astype(jnp.int32)


def _last(mask: jax.Array, default) -> jax.Array:
    size = mask.shape[-1]
    return jnp.where(jnp.any(mask), size - 1 - jnp.argmax(mask[::-1]), default).astype(jnp.int32)


def canonical_number(chars: jax.Array, num_chars: jax.Array):
    """Jittable `extract_number`: (canonical text [C + 2], length, found)."""
    size = chars.shape[-1]
    pos = jnp.arange(size)
    valid = pos < num_chars
    digit = valid & _is_digit(chars)
    numeric = digit | (valid & ((chars == ord(",")) | (chars == ord("."))))
    mark = parsing.find_subsequence(jnp.where(valid, chars, FILL), num_chars,
                                    [ord(ch) for ch in ANSWER_MARK])
    has_mark = mark >= 0
    candidates = digit & (pos >= jnp.where(has_mark, mark + len(ANSWER_MARK), 0))
    found = jnp.any(candidates)
    target = jnp.where(has_mark, _first(candidates, 0), _last(candidates, 0))
    run_start = numeric & ~jnp.concatenate([jnp.zeros((1,), bool), numeric[:-1]])
    run_id = jnp.cumsum(run_start.astype(jnp.int32))
    in_run = numeric & (run_id == run_id[target])
    start = _first(in_run, 0)
    end = _last(in_run & digit, -1) + 1  # cut after the run's last digit
    span = in_run & (pos < end)
    dots = span & (chars == ord("."))
    found = found & (jnp.sum(dots) <= 1)
    dot = _first(dots, end)
    nonzero = chars != ord("0")
    integer = span & digit & (pos < dot)
    fraction = span & digit & (pos > dot)
    keep_integer = integer & (pos >= _first(integer & nonzero, size))
    keep_fraction = fraction & (pos <= _last(fraction & nonzero, -1))
    has_fraction = jnp.any(keep_fraction)
    empty_integer = ~jnp.any(keep_integer)
    before = jnp.take(chars, jnp.clip(start - 1, 0, size - 1))
    before2 = jnp.take(chars, jnp.clip(start - 2, 0, size - 1))
    negative = ((start >= 1) & (before == ord("-")) & ((start < 2) | ~_is_digit(before2))
                & ~(empty_integer & ~has_fraction))
    keep = keep_integer | (dots & has_fraction) | keep_fraction
    values = jnp.concatenate([jnp.asarray([ord("-"), ord("0")], jnp.int32), chars])
    flags = jnp.concatenate([jnp.stack([negative, empty_integer]), keep])
    out, length = compact(values, flags & found, size + 2)
    return out, length, found


def strip_chars(chars: jax.Array, num_chars: jax.Array):
    """Jittable `strip_text`: (stripped text [C], length, non-empty)."""
    size = chars.shape[-1]
    pos = jnp.arange(size)
    text = (pos < num_chars) & ~_is_in(chars, WHITESPACE)
    first = _first(text, 0)
    length = jnp.where(jnp.any(text), _last(text, 0) - first + 1, 0).astype(jnp.int32)
    shifted = jnp.take(chars, jnp.clip(first + pos, 0, size - 1))
    return jnp.where(pos < length, shifted, FILL), length, length > 0


def normalized_chars(chars: jax.Array, num_chars: jax.Array):
    """Jittable `normalize_text`: (normalised text [C], length, non-empty)."""
    size = chars.shape[-1]
    pos = jnp.arange(size)
    upper = (chars >= ord("A")) & (chars <= ord("Z"))
    lowered = jnp.where(upper, chars + 32, chars)
    kept, count = compact(lowered, (pos < num_chars) & ~_is_in(lowered, PUNCTUATION), size)
    valid = pos < count
    space = valid & _is_in(kept, WHITESPACE)
    word = valid & ~space
    previous_space = jnp.concatenate([jnp.zeros((1,), bool), space[:-1]])
    word_before = jnp.cumsum(word.astype(jnp.int32)) > 0
    word_after = jnp.cumsum(word[::-1].astype(jnp.int32))[::-1] > 0
    one_space = space & ~previous_space & word_before & word_after
    out, length = compact(jnp.where(space, ord(" "), kept), word | one_space, size)
    return out, length, length > 0


def equal_texts(text: jax.Array, length: jax.Array, reference: jax.Array,
                reference_length: jax.Array) -> jax.Array:
    """True iff text[:length] == reference[:reference_length] (FILL-padded arrays of
    any static widths)."""
    width = max(text.shape[-1], reference.shape[-1])
    text = jnp.pad(text, (0, width - text.shape[-1]), constant_values=FILL)
    reference = jnp.pad(reference, (0, width - reference.shape[-1]), constant_values=FILL)
    pos = jnp.arange(width)
    same = jnp.all((pos >= length) | (text == reference))
    return (length == reference_length) & (length >= 0) & same

"""The seams between an env's text and the chat template's pieces: one text, one
tokenization.

`transformers` tokenizes a rendered conversation by cutting it at the special tokens
(`<|im_end|>`, `<|eot_id|>`, ...) and tokenizing each text between two of them as ONE
text. A byte-level BPE merges across anything inside such a run: Qwen's and Llama 3's
split rules keep a sign with the space before it (" -"), a closing parenthesis or a full
stop with the newline after it (")\\n", ".\\n"), a full stop with a closing quote ('."'),
newlines together ("\\n\\n"). So the context equals the reference render only if every
run of text between two special tokens is tokenized as one text, whoever writes its parts:

* the template's text next to an env's text. `framed(chat, codec)` cuts every piece
  that touches an env's text at its special token nearest to that text: the texts left
  over (`ChatFormat.prompt_around`, `reply_around`: Qwen `("user\\n", "")`, its tool
  turns `("user\\n<tool_response>\\n", "\\n</tool_response>")`, Llama 3 `("\\n\\n", "")`,
  Llama 3.1's tool turns `('\\n\\n"', '"')`) are written by the env together with its
  text (`encode_between`), the rollout wraps the result in the special parts only. Host
  envs do this on the host for every prompt and reply (`HostEnvironment`,
  `writes_template_text`); their chunks widen by those texts' tokens (`width`), so the
  budget of their own text stays what was set.
* numbers an in-graph env writes inside `jit` next to its fixed texts: `NumberInText`
  writes `before + str(value) + after` as the tokenizer writes that text (the sign
  merged with the character before it where the tokenizer merges it), checked at
  construction on numbers of every length and sign.
* the action's end: the policy ends its turn with the end-of-turn token (a special
  token), or the rollout writes one in front of the reply, so nothing the policy wrote
  merges with what follows; the action's start follows the generation prompt, whose
  last text run the policy continues as it generated it (token in, token out).

Text inside the env's own text is written as plain characters: special-token names in a
tool's output are encoded as the ordinary pieces of their characters
(`arl.text.codec.encode_text`), never deleted and never as special ids.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from arl.text import chunks
from arl.text.chunks import TokenChunk
from arl.text.codec import TRUNCATION_MARK, Codec, codec_cache, encode_text, special_ids


def _split(ids: tuple[int, ...], specials: frozenset[int], at_end: bool
           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(special part, text part) of a piece: the text after its last special token
    (`at_end`, a piece before the env's text) or before its first (a piece after it)."""
    marks = [i for i, token in enumerate(ids) if token in specials]
    if at_end:
        cut = marks[-1] + 1 if marks else 0
        return ids[:cut], ids[cut:]
    cut = marks[0] if marks else len(ids)
    return ids[cut:], ids[:cut]


def framed(chat, codec: Codec):
    """`chat` with the template's text next to the env's prompt and replies moved out of
    its pieces into `prompt_around` / `reply_around` (module docstring): the pieces then
    end and start at special tokens, and the env writes those texts with its own."""
    if chat.prompt_around != ("", "") or chat.reply_around != ("", ""):
        return chat  # already framed
    cache = codec_cache(codec, "_framed_chats")
    if chat in cache:
        return cache[chat]
    specials = special_ids(codec)
    text = lambda ids: codec.decode(np.asarray(ids, np.int32), stop_at_pad=False)
    prompt_prefix, prompt_head = _split(chat.prompt_prefix, specials, True)
    turn_suffix, prompt_tail = _split(chat.turn_suffix, specials, False)
    reply_prefix, reply_head = _split(chat.reply_prefix, specials, True)
    reply_suffix, reply_tail = _split(chat.reply_suffix, specials, False)
    around = tuple(text(ids) for ids in (prompt_head, prompt_tail, reply_head, reply_tail))
    for ids, written in zip((prompt_head, prompt_tail, reply_head, reply_tail), around):
        if tuple(encode_text(codec, written)) != tuple(ids):
            raise ValueError(f"the chat template's text {written!r} does not tokenize back "
                             f"to its piece {list(ids)}; its turns cannot be written by "
                             "the env as one text")
    out = dataclasses.replace(chat, prompt_prefix=prompt_prefix, turn_suffix=turn_suffix,
                              reply_prefix=reply_prefix, reply_suffix=reply_suffix,
                              prompt_around=around[:2], reply_around=around[2:])
    cache[chat] = out
    return out


def width(codec: Codec, head: str, tail: str) -> int:
    """Tokens of the template's texts `head` and `tail` written apart: the room an env
    adds to its text's budget for them."""
    cache = getattr(codec, "_around_widths", None)
    if cache is None:
        cache = {}
        try:
            codec._around_widths = cache  # pylint: disable=protected-access
        except AttributeError:
            pass
    if (head, tail) not in cache:
        cache[head, tail] = len(encode_text(codec, head)) + len(encode_text(codec, tail))
    return cache[head, tail]


def encode_between(codec: Codec, head: str, text: str, tail: str, size: int,
                   render: Callable[[str], str] | None = None) -> tuple[np.ndarray, int]:
    """(int32 [size] ids padded with pad_id, length) of `head + render(text) + tail`
    tokenized as one text, `text` in plain characters (`encode_text`). A text that does
    not fit is cut, as text, to its longest beginning that fits with `TRUNCATION_MARK`
    after it (so the cut is tokenized as the template's render of the cut text is);
    `render` (default: none) is how the text is written (e.g. escaped as a JSON
    string), applied after the cut so that no escape is split."""
    render = render or (lambda t: t)
    ids_of = lambda t: encode_text(codec, head + render(t) + tail)
    ids = ids_of(text)
    if len(ids) > size:
        short, long = 0, len(text)  # fits(text[:short] + mark), not fits(text[:long] ...)
        while long - short > 1:
            middle = (short + long) // 2
            if len(ids_of(text[:middle] + TRUNCATION_MARK)) <= size:
                short = middle
            else:
                long = middle
        ids = ids_of(text[:short] + TRUNCATION_MARK)
        if len(ids) > size:
            raise ValueError(f"the template's text {head!r} ... {tail!r} around a reply "
                             f"needs {len(ids)} tokens with the mark {TRUNCATION_MARK!r}, "
                             f"more than the {size} the env has for it (raise obs_len or "
                             "prompt_len)")
    out = np.full((size,), codec.pad_id, np.int32)
    out[:len(ids)] = ids
    return out, len(ids)


# Numbers every `NumberInText` is checked on: each length, each sign.
_PROBES = (0, 7, -7, 42, -42, 305, -305, 1000, -1234, 98765, -45678, 123456, -1000000,
           12345678, -987654321, 2 ** 31 - 1, -(2 ** 31) + 1)


class NumberInText:
    """Writes `before + str(value) + after` inside `jit` as the codec tokenizes that
    text, for an int32 `value` of at most `max_digits` digits (module docstring).

    The digits are the codec's digit groups (`chunks.int_chunk`); the text before is
    tokenized with the minus sign after it for a negative value (a tokenizer may merge
    the sign with the character before it: " -", "=-", "(-"), and alone otherwise; the
    text after alone. Checked at construction on numbers of every length and both signs:
    a tokenizer that merges the number with its neighbours otherwise is refused naming
    the text."""

    def __init__(self, codec: Codec, before: str = "", after: str = "", max_digits: int = 10):
        if not 1 <= max_digits <= 10:
            raise ValueError(f"max_digits must be in [1, 10], got {max_digits}")
        self.codec, self.max_digits = codec, max_digits
        self._before = encode_text(codec, before)
        self._signed = encode_text(codec, before + "-")
        self._after = encode_text(codec, after)
        self.size = max(len(self._before), len(self._signed)) + max_digits + len(self._after)
        for value in _PROBES:
            if len(str(abs(value))) > max_digits:
                continue
            expected = encode_text(codec, f"{before}{value}{after}")
            got = self.ids(value)
            if got != expected:
                raise ValueError(
                    f"the tokenizer writes {before + str(value) + after!r} as {expected}, "
                    f"but arl writes the number inside jit as {got} (the text before it, "
                    "an optional sign, the digit groups, the text after it, each tokenized "
                    "apart); arl's envs cannot write numbers next to this text with it")

    def ids(self, value: int) -> list[int]:
        """The ids `__call__` writes for `value`, on the host."""
        digits, group = str(abs(int(value))), int(self.codec.digit_group)
        table = np.asarray(self.codec.digit_group_ids)
        runs = [digits[i:i + group] for i in range(0, len(digits), group)]
        return ((self._signed if value < 0 else self._before)
                + [int(table[len(run) - 1, int(run)]) for run in runs] + self._after)

    def __call__(self, value: jax.Array) -> TokenChunk:
        """TokenChunk [size] of the text with `value` (int32, traced)."""
        value = jnp.asarray(value, jnp.int32)
        negative = value < 0
        number = chunks.int_chunk(self.codec, value, self.max_digits)
        digits = TokenChunk(jnp.roll(number.tokens, -1), number.length - 1)
        digits = jax.tree.map(lambda a, b: jnp.where(negative, a, b), digits, number)
        width = max(len(self._before), len(self._signed))
        head_tokens = np.full((2, max(width, 1)), self.codec.pad_id, np.int32)
        head_tokens[0, :len(self._before)] = self._before
        head_tokens[1, :len(self._signed)] = self._signed
        lengths = jnp.asarray([len(self._before), len(self._signed)], jnp.int32)
        row = negative.astype(jnp.int32)
        head = TokenChunk(jnp.asarray(head_tokens)[row], lengths[row])
        after = TokenChunk(jnp.asarray(self._after or [self.codec.pad_id], jnp.int32),
                           jnp.asarray(len(self._after), jnp.int32))
        return chunks.concat_all([head, digits, after], self.size, self.codec.pad_id)

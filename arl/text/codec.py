"""Vocabulary / codec: text <-> token ids, special tokens and jittable lookup tables.

Token environments never hard-code ids: they receive a `Codec` at construction and
talk only through it, so a real tokenizer can replace the built-in character-level
vocabulary later. Envs read the agent's turn as text (`arl.text.turn_text`) and write
their replies through the codec: fixed texts with `encode`, numbers inside `jit` as the
codec writes them (`digit_group_ids`, `arl.text.chunks.int_chunk`).
"""

from __future__ import annotations

import string

import numpy as np

PAD = "<pad>"
BOS = "<bos>"
EOT = "<eot>"
USER = "<user>"
AGENT = "<agent>"

# Order matters only for readability of ids; pad must be 0.
SPECIAL_TOKENS = (PAD, BOS, EOT, USER, AGENT)
CHARACTERS = (
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " \n"
    + "<>/+-*=().,:;?!_#'\"|%"
)


class Codec:
    """Interface of a vocabulary the token environments can talk through.

    Attributes every codec provides: `vocab_size`, `pad_id`, `bos_id`, `eot_id`,
    `digit_value` (int32 [vocab_size], the digit 0..9 an id stands for, else -1),
    `digit_ids` (int32 [10], the id of each digit), `digit_group` and `digit_group_ids`
    (how numbers are written), and the methods below.
    """

    vocab_size: int
    pad_id: int
    bos_id: int
    eot_id: int
    digit_value: np.ndarray
    digit_ids: np.ndarray
    # How the codec writes a number: runs of `digit_group` digits from the left, each one
    # token (1: digit by digit, as Qwen; 3: Llama 3's "1234" -> "123" "4").
    digit_group: int = 1

    @property
    def digit_group_ids(self) -> np.ndarray:
        """int32 [digit_group, 10**digit_group]: [k - 1, v] is the id of the k-digit text
        of v with leading zeros ("07" for k=2, v=7); -1 where v >= 10**k."""
        return np.asarray(self.digit_ids, np.int32)[None, :]

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids, stop_at_pad: bool = True, show_special: bool = True) -> str:
        raise NotImplementedError

    def token_id(self, char: str) -> int:
        """Id of a single character (or special-token name)."""
        ids = self.encode(char)
        if len(ids) != 1:
            raise ValueError(f"char must encode to exactly one token, got {char!r} -> {ids}")
        return ids[0]

    def encode_padded(self, text: str, length: int) -> tuple[np.ndarray, int]:
        """(int32 [length] ids padded with pad_id, number of valid ids)."""
        ids = self.encode(text)
        if len(ids) > length:
            raise ValueError(
                f"text {text!r} needs {len(ids)} tokens, more than length={length}"
            )
        out = np.full((length,), self.pad_id, np.int32)
        out[: len(ids)] = ids
        return out, len(ids)


class CharCodec(Codec):
    """Built-in character-level vocabulary (vocab_size = 5 specials + 85 characters).

    Ids: 0 `<pad>`, 1 `<bos>`, 2 `<eot>` (end of turn), 3 `<user>`, 4 `<agent>` (role
    markers), then digits, lower- and upper-case letters, space, newline and the
    punctuation ``<>/+-*=().,:;?!_#'"|%``. Special tokens are written in text as their
    names, e.g. ``encode("7<eot>") == [digit 7, eot_id]``.
    """

    def __init__(self):
        self._tokens = SPECIAL_TOKENS + tuple(CHARACTERS)
        self._ids = {tok: i for i, tok in enumerate(self._tokens)}
        self.vocab_size = len(self._tokens)
        self.pad_id = self._ids[PAD]
        self.bos_id = self._ids[BOS]
        self.eot_id = self._ids[EOT]
        self.user_id = self._ids[USER]
        self.agent_id = self._ids[AGENT]
        self.digit_ids = np.array([self._ids[d] for d in string.digits], np.int32)
        self.digit_value = np.full((self.vocab_size,), -1, np.int32)
        self.digit_value[self.digit_ids] = np.arange(10, dtype=np.int32)

    def __repr__(self) -> str:
        return f"CharCodec(vocab_size={self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        ids = []
        i = 0
        while i < len(text):
            if text[i] == "<":
                special = next((s for s in SPECIAL_TOKENS if text.startswith(s, i)), None)
                if special is not None:
                    ids.append(self._ids[special])
                    i += len(special)
                    continue
            char = text[i]
            if char not in self._ids:
                raise ValueError(
                    f"text contains {char!r} at position {i}, which is not in the "
                    f"CharCodec vocabulary (allowed: {CHARACTERS!r} and {SPECIAL_TOKENS})"
                )
            ids.append(self._ids[char])
            i += 1
        return ids

    def decode(self, ids, stop_at_pad: bool = True, show_special: bool = True) -> str:
        """Text of `ids`; stops at the first pad if `stop_at_pad`, else skips pads.

        Ids outside the vocabulary decode as ``<?>`` (agents can emit anything).
        """
        parts = []
        for raw in np.asarray(ids).reshape(-1).tolist():
            if raw == self.pad_id:
                if stop_at_pad:
                    break
                continue
            if not 0 <= raw < self.vocab_size:
                parts.append("<?>")
                continue
            tok = self._tokens[raw]
            if tok in SPECIAL_TOKENS and not show_special:
                continue
            parts.append(tok)
        return "".join(parts)


def stop_ids(codec: Codec) -> tuple[int, ...]:
    """The ids that end an agent turn, `eot_id` first: a checkpoint's codec
    (`HFCodec.from_pretrained`) has its template's end of turn and every eos id of its
    generation_config.json, as `generate()` stops on them; other codecs their eot_id."""
    ids = getattr(codec, "stop_ids", None) or ()
    return (int(codec.eot_id),) + tuple(int(i) for i in ids if int(i) != codec.eot_id)


# ------------------------------------------------------- host-side text <-> ids (NumPy)
# How a host environment turns the agent's ids into text and its replies into ids.

TRUNCATION_MARK = ".."  # ends a reply cut to obs_len (characters of the built-in codec)
UNKNOWN_CHAR = "?"      # stands for a character the codec cannot write


def decode_action(codec: Codec, tokens, length) -> str:
    """Text of the agent's turn `tokens[:length]` (special tokens spelled by name)."""
    tokens = np.asarray(tokens).reshape(-1)
    length = int(np.clip(int(length), 0, tokens.shape[0]))
    return codec.decode(tokens[:length], stop_at_pad=False)


def codec_cache(codec: Codec, attribute: str) -> dict:
    """A dict kept on `codec` under `attribute` for tables derived from it (built once per
    codec); a fresh dict each call where the codec takes no attributes."""
    cache = getattr(codec, attribute, None)
    if cache is None:
        cache = {}
        try:
            setattr(codec, attribute, cache)
        except AttributeError:
            pass
    return cache


def special_ids(codec: Codec) -> frozenset[int]:
    """The ids of the codec's special tokens (pad, bos, end of turn, a checkpoint's
    added special tokens): the ids a chat template's pieces are cut at."""
    ids = {codec.pad_id, codec.bos_id, codec.eot_id}
    ids |= set(getattr(codec, "special_ids", ()) or ())
    return frozenset(int(i) for i in ids if i is not None)


def encode_text(codec: Codec, text: str) -> list[int]:
    """`text` as plain characters: special-token names in it are written as the ordinary
    pieces of their characters, never as special ids and never dropped (a program may
    print "<eot>" or "<|im_end|>"); characters the codec lacks become "?"."""
    if isinstance(codec, CharCodec):
        ids, unknown = [], codec.token_id(UNKNOWN_CHAR)
        table = codec._ids  # pylint: disable=protected-access
        for char in text:
            ids.append(table.get(char, unknown))
        return ids
    plain = getattr(codec, "encode_plain", None)
    if plain is not None:
        return list(plain(text))
    try:
        ids = codec.encode(text)
    except (ValueError, KeyError):
        ids = None
    if ids is not None and not any(i in special_ids(codec) for i in ids):
        return list(ids)
    ids = []  # character by character: a special token's name is no single character
    for char in text:
        try:
            ids.extend(codec.encode(char))
        except (ValueError, KeyError):
            ids.extend(codec.encode(UNKNOWN_CHAR))
    return ids


def encode_reply(codec: Codec, text: str, size: int) -> tuple[np.ndarray, int]:
    """(int32 [size] ids padded with pad_id, length) of `text` (`encode_text`); a text
    longer than `size` tokens is cut and ends in `TRUNCATION_MARK`."""
    ids = encode_text(codec, text)
    if len(ids) > size:
        mark = encode_text(codec, TRUNCATION_MARK)
        keep = max(size - len(mark), 0)
        ids = (ids[:keep] + mark)[:size]
    out = np.full((size,), codec.pad_id, np.int32)
    out[:len(ids)] = ids
    return out, len(ids)


def encode_action(codec: Codec, text: str, size: int) -> tuple[np.ndarray, int]:
    """A scripted turn: `text` then the end-of-turn id, cut to `size` tokens."""
    ids = (encode_text(codec, text) + [codec.eot_id])[:size]
    out = np.full((size,), codec.pad_id, np.int32)
    out[:len(ids)] = ids
    return out, len(ids)

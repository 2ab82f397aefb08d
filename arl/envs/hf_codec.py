"""A `Codec` over a Hugging Face `tokenizers` tokenizer (a `tokenizer.json`).

Token environments tokenize their fixed strings (prompts, replies, tool tags) once at
construction through `codec.encode`, and parse the agent's turn from token ids inside
`jit` with id-level patterns (`arl.envs.parsing`). For that to work with a subword
vocabulary the codec checks, at construction, what the parsers rely on:

* every decimal digit "0".."9" is exactly one token (Llama 2, Qwen2 and the BPE that
  `train_bpe_tokenizer` builds split numbers into digits), so numbers are parsed digit
  by digit from `digit_value`;
* the pad, bos and end-of-turn markers are single (special) tokens;
* each of `single_token_chars` (the punctuation the built-in environments parse, such
  as "-", "<", ">", "+", "*") is one token on its own.

Agents are judged on the canonical tokenization: a tag like "<calc>" is recognised as
the ids of `codec.encode("<calc>")`. A tokenizer whose pre-tokenizer isolates every
punctuation character (as `train_bpe_tokenizer` does) makes that tokenization the same
in isolation and in context; with other tokenizers an agent may spell a tag with ids
the environment does not accept, which is then a format error like any other typo.

Chat formatting (`chat_ids`): `[bos] (<role> content <eot>)* [<assistant>]`, with one
special token per role; the rollout itself starts from `[bos] + prompt`.
"""

from __future__ import annotations

import os
import string
from typing import Iterable, Sequence

import numpy as np

from arl.envs.codec import Codec

PAD, BOS, EOT = "<pad>", "<bos>", "<eot>"
SYSTEM, USER, ASSISTANT = "<system>", "<user>", "<agent>"
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
SPECIAL_TOKENS = (PAD, BOS, EOT, SYSTEM, USER, ASSISTANT)
# Characters the built-in token environments parse one id at a time.
PARSED_CHARS = "-+*<>/"


class HFCodec(Codec):
    """Codec of a `tokenizers.Tokenizer`.

    Args:
      tokenizer: a `tokenizers.Tokenizer`, or a path to a `tokenizer.json`.
      pad_token, bos_token, eot_token: names of the pad / begin / end-of-turn tokens
        (each must be one token of the vocabulary).
      role_tokens: role name -> token, for `chat_ids` (each must be one token).
      single_token_chars: characters that must each be a single token (see module doc).

    Raises ValueError naming the offending token when a requirement does not hold.
    """

    def __init__(self, tokenizer, pad_token: str = PAD, bos_token: str = BOS,
                 eot_token: str = EOT, role_tokens: dict[str, str] | None = None,
                 single_token_chars: str = PARSED_CHARS):
        from tokenizers import Tokenizer

        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = Tokenizer.from_file(os.fspath(tokenizer))
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer or a path to a "
                            f"tokenizer.json, got {type(tokenizer)!r}")
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.pad_id = self._single_id(pad_token, "pad_token")
        self.bos_id = self._single_id(bos_token, "bos_token")
        self.eot_id = self._single_id(eot_token, "eot_token")
        role_tokens = dict(ROLE_TOKENS if role_tokens is None else role_tokens)
        self.role_ids = {role: self._single_id(tok, f"role_tokens[{role!r}]")
                         for role, tok in role_tokens.items()}
        self.digit_ids = np.array([self.token_id(d) for d in string.digits], np.int32)
        self.digit_value = np.full((self.vocab_size,), -1, np.int32)
        self.digit_value[self.digit_ids] = np.arange(10, dtype=np.int32)
        for char in single_token_chars:
            self.token_id(char)
        self._special_ids = {self.pad_id, self.bos_id, self.eot_id, *self.role_ids.values()}

    def _single_id(self, token: str, what: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{what}={token!r} is not a token of the tokenizer's vocabulary")
        return int(token_id)

    def __repr__(self) -> str:
        return f"HFCodec(vocab_size={self.vocab_size})"

    def token_id(self, char: str) -> int:
        ids = self.encode(char)
        if len(ids) != 1:
            raise ValueError(f"HFCodec needs {char!r} to be exactly one token, but the "
                             f"tokenizer encodes it as {ids}; use a tokenizer that splits "
                             f"digits and isolates punctuation (see train_bpe_tokenizer)")
        return ids[0]

    def encode(self, text: str) -> list[int]:
        """Ids of `text` without automatically added bos/eos; special tokens written in
        the text (e.g. "<eot>") become their ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids, stop_at_pad: bool = True, show_special: bool = True) -> str:
        """Text of `ids`; stops at the first pad if `stop_at_pad`, else skips pads.
        Ids outside the vocabulary decode as ``<?>``."""
        pieces: list[str] = []
        run: list[int] = []

        def flush():
            if run:
                pieces.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run.clear()

        for raw in np.asarray(ids).reshape(-1).tolist():
            if raw == self.pad_id:
                if stop_at_pad:
                    break
                continue
            if not 0 <= raw < self.vocab_size:
                flush()
                pieces.append("<?>")
            elif raw in self._special_ids:
                flush()
                if show_special:
                    pieces.append(self.tokenizer.id_to_token(raw))
            else:
                run.append(raw)
        flush()
        return "".join(pieces)

    def chat_ids(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """`[bos] + sum(<role> encode(content) <eot>) [+ <assistant>]` of
        messages = [{"role": "system" | "user" | "assistant", "content": str}, ...]."""
        ids = [self.bos_id]
        for k, message in enumerate(messages):
            role = message.get("role")
            if role not in self.role_ids:
                raise ValueError(f"messages[{k}]['role'] must be one of "
                                 f"{sorted(self.role_ids)}, got {role!r}")
            ids += [self.role_ids[role]] + self.encode(message["content"]) + [self.eot_id]
        if add_generation_prompt:
            ids.append(self.role_ids["assistant"])
        return ids


def env_corpus(num_expressions: int = 300, seed: int = 0) -> list[str]:
    """Training text for a tokenizer of the built-in arithmetic / guessing environments:
    their prompts, replies and tool-call turns (calculator and guess_number)."""
    from arl.envs.tasks import calculator, guess_number

    rng = np.random.default_rng(seed)
    lines = [f"guess 0-{n - 1}" for n in (8, 16, 100, 1000)]
    lines += list(guess_number.REPLIES) + list(calculator.REPLIES)
    for _ in range(num_expressions):
        a, b = rng.integers(-999, 1000, 2)
        op = "+-*"[rng.integers(3)]
        lines += [f"<calc>{a}{op}{b}</calc>", f"<answer>{a}</answer>", f"{a}{op}{b}"]
    return lines


def train_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 256,
                        special_tokens: Sequence[str] = SPECIAL_TOKENS):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` that `HFCodec` accepts.

    Pre-tokenization: every punctuation character and every digit is its own piece, then
    byte-level (GPT-2) splitting of the rest, so merges only ever join letters/spaces and
    the digits and tool punctuation stay single tokens. `special_tokens` come first
    (pad is id 0). All 256 bytes are in the initial alphabet, so any text encodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation(behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    return tokenizer

"""A `Codec` over a Hugging Face `tokenizers` tokenizer (a `tokenizer.json`).

Token environments tokenize their fixed strings (prompts, replies, tool tags) once at
construction through `codec.encode`, read the agent's turn as text inside `jit`
(`arl.text.turn_text`) and write numbers as the tokenizer does. For that the codec
checks, at construction:

* every decimal digit "0".."9" is one token, and the tokenizer writes a number as runs of
  1 to 3 digits from the left, each one token (`digit_group`: 1 for Qwen, Llama 2 and
  the default `train_bpe_tokenizer`; 3 for Llama 3, whose pre-tokenizer merges up to
  three digits);
* the pad, bos and end-of-turn markers are single (special) tokens;
* each of `single_token_chars` (the punctuation the built-in environments parse, such
  as "-", "<", ">", "+", "*") is one token on its own.

Agents are judged on their text, whatever ids spell it: "<calc>1+2</calc>" is a tool
call whether the tag is one id or six.

Chat formatting (`chat_ids`): `[bos] (<role> content <eot>)* [<assistant>]`, with one
special token per role; the rollout itself starts from `[bos] + prompt`.

A checkpoint directory (`HFCodec.from_pretrained`): `tokenizer.json` with the tokens
`tokenizer_config.json` names (pad, eos, optional bos: a model without a BOS gets none),
its added special tokens and its chat template (`chat_template` there, or a
`chat_template.jinja` file next to it). With a template the codec carries its
`ChatFormat` (`arl.text.chat_template`): the rollout then wraps the prompt and every
reply in the template's pieces, and the end-of-turn token is the one the template
closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`); without one, the eos token.
The pad token is tokenizer_config's pad_token, else generation_config.json's
pad_token_id, else the first added special token that is neither the end-of-turn token,
the BOS nor part of the template's pieces (pad ids only fill unused positions).
"""

from __future__ import annotations

import dataclasses
import json
import os
import string
from typing import Any, Iterable, Sequence

import numpy as np

from arl.text.codec import Codec

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
        (each must be one token of the vocabulary; bos_token None: the model has no BOS,
        `bos_id` is None and nothing is put in front of the prompt).
      role_tokens: role name -> token, for `chat_ids` (each must be one token).
      single_token_chars: characters that must each be a single token (see module doc).

    Raises ValueError naming the offending token when a requirement does not hold.
    """

    # Set by `from_pretrained`: the checkpoint's chat format (None: raw turns).
    chat = None

    def __init__(self, tokenizer, pad_token: str = PAD, bos_token: str | None = BOS,
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
        self.bos_id = None if bos_token is None else self._single_id(bos_token, "bos_token")
        self.eot_id = self._single_id(eot_token, "eot_token")
        role_tokens = dict(ROLE_TOKENS if role_tokens is None else role_tokens)
        self.role_ids = {role: self._single_id(tok, f"role_tokens[{role!r}]")
                         for role, tok in role_tokens.items()}
        self.digit_ids = np.array([self.token_id(d) for d in string.digits], np.int32)
        self.digit_value = np.full((self.vocab_size,), -1, np.int32)
        self.digit_value[self.digit_ids] = np.arange(10, dtype=np.int32)
        self.digit_group, self._digit_group_ids = _digit_grouping(self)
        for char in single_token_chars:
            self.token_id(char)
        self.special_ids = {self.pad_id, self.eot_id, *self.role_ids.values()} | (
            set() if self.bos_id is None else {self.bos_id})

    @classmethod
    def from_pretrained(cls, directory: str, system_prompt: str | None = None,
                        single_token_chars: str = PARSED_CHARS,
                        template_kwargs: dict | None = None) -> "HFCodec":
        """The codec of a Hugging Face checkpoint directory (module docstring), with its
        chat format for conversations that start with `system_prompt` (None: no system
        message, i.e. the template's own default), rendered with the template's own
        arguments `template_kwargs` (`enable_thinking`, `tools`, ...). Raises ValueError
        naming the file and field that does not fit (`ChatTemplateError` for a template
        whose first turn cannot be split into static pieces)."""
        from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

        from arl.text import chat_template  # pylint: disable=g-import-not-at-top

        directory = os.fspath(directory)
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory!r} has no tokenizer.json (a Hugging Face "
                                    "checkpoint directory holds tokenizer.json and "
                                    "tokenizer_config.json)")
        tokenizer = Tokenizer.from_file(path)
        settings = _read_json(os.path.join(directory, "tokenizer_config.json"))
        generation = _read_json(os.path.join(directory, "generation_config.json"))
        names = {field: _token_name(settings.get(field)) for field in
                 ("bos_token", "eos_token", "pad_token", "unk_token")}
        for field, name in names.items():
            if name is not None and tokenizer.token_to_id(name) is None:
                raise ValueError(f"tokenizer_config.json: {field}={name!r} is not a token of "
                                 f"{path!r}")
        specials = [t.content for t in tokenizer.get_added_tokens_decoder().values()
                    if t.special]
        template = _chat_template(directory, settings)
        pad_name = names["pad_token"]
        if pad_name is None and isinstance(generation.get("pad_token_id"), int):
            pad_name = tokenizer.id_to_token(generation["pad_token_id"])
        encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False).ids)
        chat = None
        if template is not None:
            chat = chat_template.derive_chat_format(
                template, encode=encode, special_texts=specials,
                special_tokens={k: v for k, v in names.items() if v is not None},
                pad_id=-1, system_prompt=system_prompt, template_kwargs=template_kwargs)
            eot_name = tokenizer.id_to_token(chat.eot_id)
        elif names["eos_token"] is not None:
            eot_name = names["eos_token"]
        else:
            raise ValueError(f"{directory!r}: tokenizer_config.json has neither a chat_template "
                             "nor an eos_token, so no token ends a turn")
        if pad_name is None:
            used = set() if chat is None else set(chat.prompt_prefix + chat.turn_suffix
                                                  + chat.reply_prefix)
            pad_name = next((t for t in specials if t not in (eot_name, names["bos_token"])
                             and tokenizer.token_to_id(t) not in used), None)
            if pad_name is None:
                raise ValueError(f"{directory!r}: tokenizer_config.json has no pad_token and "
                                 "the tokenizer no spare special token to pad with: set "
                                 "pad_token in tokenizer_config.json")
        codec = cls(tokenizer, pad_token=pad_name, bos_token=names["bos_token"],
                    eot_token=eot_name, role_tokens={},
                    single_token_chars=single_token_chars)
        codec.special_ids |= {tokenizer.token_to_id(t) for t in specials}
        codec.stop_ids = (codec.eot_id,) + tuple(
            i for i in _eos_ids(directory, generation, codec.vocab_size) if i != codec.eot_id)
        codec.directory = directory
        codec.chat_template = template
        codec.template_tokens = {k: v for k, v in names.items() if v is not None}
        codec.template_kwargs = dict(template_kwargs or {})
        if chat is None:  # raw turns; a BOS only where the model has one
            chat = chat_template.ChatFormat(
                prompt_prefix=() if codec.bos_id is None else (codec.bos_id,), turn_suffix=(),
                reply_prefix=(), eot_id=codec.eot_id, pad_id=codec.pad_id)
        codec.chat = dataclasses.replace(chat, pad_id=codec.pad_id)
        return codec

    @property
    def digit_group_ids(self) -> np.ndarray:
        return self._digit_group_ids

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

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with special-token names in it written as plain characters (the
        ordinary pieces of their characters, as `transformers` with
        `split_special_tokens=True`): what an env's or tool's text is encoded with."""
        plain = self.__dict__.get("_plain_tokenizer")
        if plain is None:  # a copy: the shared tokenizer keeps matching special tokens
            from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
            plain = Tokenizer.from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain_tokenizer = plain
        return list(plain.encode(text, add_special_tokens=False).ids)

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
            elif raw in self.special_ids:
                flush()
                if show_special:
                    pieces.append(self.tokenizer.id_to_token(raw))
            else:
                run.append(raw)
        flush()
        return "".join(pieces)

    def chat_ids(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """`[bos] + sum(<role> encode(content) <eot>) [+ <assistant>]` of
        messages = [{"role": "system" | "user" | "assistant", "content": str}, ...];
        a checkpoint's codec (`from_pretrained`) renders its chat template instead."""
        template = getattr(self, "chat_template", None)
        if template is not None:
            from arl.text import chat_template  # pylint: disable=g-import-not-at-top
            return self.encode(chat_template.render(
                template, messages, add_generation_prompt=add_generation_prompt,
                special_tokens=self.template_tokens,
                template_kwargs=getattr(self, "template_kwargs", None)))
        if self.bos_id is None or not self.role_ids:
            raise ValueError("chat_ids needs role tokens and a bos token, or a chat template "
                             "(HFCodec.from_pretrained)")
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


_PROBE_NUMBER = "1234567"


def _digit_grouping(codec: "HFCodec") -> tuple[int, np.ndarray]:
    """(g, int32 [g, 10**g] ids of every k-digit text, k <= g) of a tokenizer that writes
    a number as runs of g digits from the left, each one token (g = 1: Qwen, Llama 2;
    g = 3: Llama 3's pre-tokenizer `\\p{N}{1,3}`). Raises ValueError for any other way."""
    pieces = [codec.tokenizer.decode([i]) for i in codec.encode(_PROBE_NUMBER)]
    group = len(pieces[0]) if pieces else 0
    expected = [_PROBE_NUMBER[i:i + group] for i in range(0, len(_PROBE_NUMBER), max(group, 1))]
    if group not in (1, 2, 3) or pieces != expected:
        raise ValueError(f"the tokenizer writes the number {_PROBE_NUMBER} as {pieces}; arl's "
                         "environments write numbers inside jit as runs of 1 to 3 digits from "
                         "the left, one token each (Qwen: 1, Llama 3: 3)")
    table = np.full((group, 10 ** group), -1, np.int32)
    for width in range(1, group + 1):
        texts = [str(v).zfill(width) for v in range(10 ** width)]
        for value, encoding in enumerate(codec.tokenizer.encode_batch(
                texts, add_special_tokens=False)):
            if len(encoding.ids) != 1:
                raise ValueError(f"the tokenizer merges up to {group} digits into one token "
                                 f"but writes {texts[value]!r} as {encoding.ids}; arl's "
                                 f"environments need every text of 1 to {group} digits to be "
                                 "one token")
            table[width - 1, value] = encoding.ids[0]
    return group, table


def _eos_ids(directory: str, generation: dict[str, Any], vocab_size: int) -> list[int]:
    """The eos ids `generate()` stops on: generation_config.json's eos_token_id (an id or
    a list), else config.json's."""
    name = "generation_config.json"
    value = generation.get("eos_token_id")
    if value is None:
        name = "config.json"
        value = _read_json(os.path.join(directory, name)).get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab_size:
            raise ValueError(f"{os.path.join(directory, name)}: eos_token_id must be token ids "
                             f"in [0, {vocab_size}), got {value!r}")
    return list(dict.fromkeys(values))


def _read_json(path: str) -> dict[str, Any]:
    """The object in a JSON file, {} if there is none."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") \
                from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken
    dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(directory: str, settings: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja if present (transformers >= 4.5x
    writes it there), else tokenizer_config.json's chat_template (a string, or a list of
    {"name", "template"} of which "default" is used)."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = settings.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None


# The pre-tokenizer split rule of real byte-level vocabularies (tokenizer.json's Split
# regex, Llama 3's; Qwen2's has `\p{N}` for `\p{N}{1,3}`): letters with one leading
# non-letter, runs of digits, runs of punctuation with one leading space and the
# newlines after them (" -", ")\n", '."'), runs of newlines ("\n\n").
REAL_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = ("isolated", "real")
# Merges real vocabularies have across the seams between an env's text and the template
# (`arl.text.seams`): a sign after a space, a closing parenthesis or full stop before a
# newline, a full stop before a closing quote, a blank line.
SEAM_MERGES = (" -", ")\n", ".\n", '."', "\n\n")


def train_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 256,
                        special_tokens: Sequence[str] = SPECIAL_TOKENS, digit_group: int = 1,
                        split: str = "isolated"):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` that `HFCodec` accepts.

    Pre-tokenization (`split`): "isolated" makes every punctuation character its own
    piece, then byte-level (GPT-2) splitting of the rest, so merges only ever join
    letters/spaces; "real" splits as Qwen2's and Llama 3's tokenizer.json do
    (`REAL_SPLIT`: punctuation runs with a leading space and trailing newlines stay one
    piece, as do runs of newlines) and adds the merges of `SEAM_MERGES` where training
    did not learn them, so text merges where real vocabularies merge it. Digits are
    split into runs of `digit_group` from the left: 1 keeps digits single tokens (Qwen);
    3 adds one token for every text of two and three digits, as Llama 3's vocabulary
    has (its pre-tokenizer `\\p{N}{1,3}`), after the `vocab_size` learned ones.
    `special_tokens` come first (pad is id 0). All 256 bytes are in the initial
    alphabet, so any text encodes.
    """
    import json  # pylint: disable=g-import-not-at-top,reimported

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if digit_group not in (1, 3):
        raise ValueError(f"digit_group must be 1 or 3, got {digit_group!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")

    rule = REAL_SPLIT if digit_group == 3 else REAL_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

    def pre_tokenizer():
        if split != "isolated":
            return pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(rule), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return pre_tokenizers.Sequence([
            pre_tokenizers.Punctuation(behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True) if digit_group == 1 else
            pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation(behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]) if split == "isolated" else pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    if digit_group == 1 and split == "isolated":
        return tokenizer
    state = json.loads(tokenizer.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    known = {tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges}

    def add(left, right):
        if (left, right) not in known:
            merges.append([left, right])
            known.add((left, right))
        vocab.setdefault(left + right, len(vocab))

    if split != "isolated":  # in byte-level characters: " " is "\u0120", "\n" "\u010a"
        byte = lambda text: text.replace(" ", "\u0120").replace("\n", "\u010a")
        for text in SEAM_MERGES:
            add(byte(text[0]), byte(text[1:]))
    if digit_group == 3:
        # Learned merges need not build every digit run: add the merges that build every
        # 2- and 3-digit text ("ab"+"c" or "a"+"bc", as ranked).
        for text in [f"{v:02d}" for v in range(100)]:
            add(text[0], text[1])
        for text in [f"{v:03d}" for v in range(1000)]:
            add(text[:2], text[2])
            add(text[0], text[1:])
    state["model"]["merges"] = [list(m) for m in merges]
    state["pre_tokenizer"] = None
    tokenizer = Tokenizer.from_str(json.dumps(state))
    tokenizer.pre_tokenizer = pre_tokenizer()
    return tokenizer

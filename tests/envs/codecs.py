"""The three codecs every token env is tested under: arl's character codec, a
Qwen-style BPE (digits single tokens) and a Llama-3-style BPE (runs of up to three
digits one token, `train_bpe_tokenizer(digit_group=3)`). Built once per process."""

from __future__ import annotations

import functools

from arl.text.codec import CharCodec

CODEC_NAMES = ("char", "qwen_bpe", "llama3_bpe")


def _corpus() -> list[str]:
    from configs.tokenizer_corpus import env_corpus
    from arl.envs.tasks import countdown, frozen_lake, sokoban

    words = ["numbers", " target ", "arms: ", "safe", "risky", "invalid", "wrong: ",
             "higher", "lower", "correct", "Left", "Down", "Right", "Up", "left", "down",
             "right", "up", "Left,Down,Right,Up", "the answer is", "wrong, try again"]
    return (env_corpus(num_expressions=150) + words + list(countdown.REPLIES)
            + [frozen_lake.SYMBOLS, sokoban.SYMBOLS] * 3)


@functools.lru_cache(maxsize=None)
def codec(name: str):
    """The codec called `name` (one of CODEC_NAMES)."""
    from arl.text.hf_codec import HFCodec, train_bpe_tokenizer

    if name == "char":
        return CharCodec()
    if name not in CODEC_NAMES:
        raise ValueError(f"name must be one of {CODEC_NAMES}, got {name!r}")
    group = 3 if name == "llama3_bpe" else 1
    return HFCodec(train_bpe_tokenizer(_corpus(), vocab_size=320, digit_group=group))

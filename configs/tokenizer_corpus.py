"""Training text for a tokenizer of the built-in arithmetic / guessing environments
(`env_corpus`), e.g. for `arl.text.hf_codec.train_bpe_tokenizer`: the BPE that
configs/llama_calculator.py trains (the tests' stand-in tokenizers use it too). Not a
config (no `get_config`): a piece of one, like recipes.py."""

from __future__ import annotations

import numpy as np

from arl.envs.tasks import calculator, guess_number


def env_corpus(num_expressions: int = 300, seed: int = 0) -> list[str]:
    """Training text for a tokenizer of the built-in arithmetic / guessing environments:
    their prompts, replies and tool-call turns (calculator and guess_number)."""
    rng = np.random.default_rng(seed)
    lines = [f"guess 0-{n - 1}" for n in (8, 16, 100, 1000)]
    lines += list(guess_number.REPLIES) + list(calculator.REPLIES)
    for _ in range(num_expressions):
        a, b = rng.integers(-999, 1000, 2)
        op = "+-*"[rng.integers(3)]
        lines += [f"<calc>{a}{op}{b}</calc>", f"<answer>{a}</answer>", f"{a}{op}{b}"]
    return lines

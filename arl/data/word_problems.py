"""Templated arithmetic word problems (a small GSM8K-shaped task for CPU experiments).

    problems = generate(num_problems=300, seed=0)   # [{"prompt": ..., "answer": ...}]

Each problem is one or two arithmetic steps on small whole numbers told as a story, e.g.
"Tom has 12 apples. He buys 7 more. How many apples does he have now?" -> "19". Kinds:
add, subtract, multiply (groups of equal size), divide (equal shares, always exact) and
two-step (add then subtract); every answer is a whole number >= 0. Operands stay small
(sums of numbers up to 15, products of factors up to 6) so that a small character-level
model can learn the arithmetic, not only the reading.

Deterministic: the same (num_problems, seed) gives the same list on every platform and
Python version (only `random.Random.random` is drawn, whose sequence Python guarantees).
Duplicate prompts are skipped, so every prompt is distinct. The text uses only
characters of `arl.envs.CharCodec`. `experiments/make_arithmetic_word_problems.py` writes
the list as JSONL; the shipped `arithmetic_word_problems.jsonl` next to this module is
`generate(300, seed=0)`.
"""

from __future__ import annotations

import json
import os
import random

SHIPPED_JSONL = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "arithmetic_word_problems.jsonl")
SHIPPED_COUNT = 300
SHIPPED_SEED = 0

PEOPLE = (("Tom", "he"), ("Ana", "she"), ("Sam", "he"), ("Mia", "she"), ("Leo", "he"),
          ("Eva", "she"), ("Ben", "he"), ("Zoe", "she"))
ITEMS = ("apples", "books", "coins", "marbles", "cards", "pens", "shells", "stickers")
KINDS = ("add", "subtract", "multiply", "divide", "two_step")


class _Draw:
    """Uniform choices from `random.Random.random` only (stable across Python versions)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        """Uniform in [low, high]."""
        return low + min(int(self._rng.random() * (high - low + 1)), high - low)

    def choice(self, options):
        return options[self.integer(0, len(options) - 1)]


def _problem(draw: _Draw) -> tuple[str, int]:
    name, pronoun = draw.choice(PEOPLE)
    other, _ = draw.choice([p for p in PEOPLE if p[0] != name])
    item = draw.choice(ITEMS)
    he = pronoun.capitalize()
    kind = draw.choice(KINDS)
    if kind == "add":
        a, b = draw.integer(2, 15), draw.integer(2, 15)
        text = draw.choice((
            f"{name} has {a} {item}. {he} buys {b} more. How many {item} does {pronoun} "
            "have now?",
            f"{name} has {a} {item} and {other} gives {pronoun} {b} more. How many {item} "
            f"does {name} have?",
            f"{name} finds {a} {item} on Monday and {b} {item} on Tuesday. How many {item} "
            f"does {pronoun} find in all?",
        ))
        return text, a + b
    if kind == "subtract":
        a = draw.integer(5, 20)
        b = draw.integer(1, a - 1)
        text = draw.choice((
            f"{name} has {a} {item}. {he} gives {b} to {other}. How many {item} does "
            f"{pronoun} have left?",
            f"{name} had {a} {item} and lost {b} of them. How many {item} are left?",
            f"There are {a} {item} in a box. {name} takes {b} out. How many {item} are "
            "still in the box?",
        ))
        return text, a - b
    if kind == "multiply":
        a, b = draw.integer(2, 6), draw.integer(2, 6)
        text = draw.choice((
            f"{name} has {a} bags with {b} {item} in each bag. How many {item} does "
            f"{pronoun} have?",
            f"{name} buys {a} packs of {item}. Each pack has {b} {item}. How many {item} "
            f"does {pronoun} buy?",
        ))
        return text, a * b
    if kind == "divide":
        share, people = draw.integer(2, 6), draw.integer(2, 5)
        total = share * people
        text = draw.choice((
            f"{name} shares {total} {item} equally among {people} friends. How many "
            f"{item} does each friend get?",
            f"{total} {item} are put into {people} equal piles. How many {item} are in "
            "each pile?",
        ))
        return text, share
    a, b = draw.integer(3, 12), draw.integer(2, 9)
    c = draw.integer(1, a + b - 1)
    text = (f"{name} has {a} {item}. {he} buys {b} more and then gives {c} to {other}. "
            f"How many {item} does {pronoun} have now?")
    return text, a + b - c


def generate(num_problems: int = SHIPPED_COUNT, seed: int = SHIPPED_SEED) -> list[dict]:
    """`num_problems` distinct problems as {"prompt": str, "answer": str} (the answer's
    decimal digits)."""
    if isinstance(num_problems, bool) or not isinstance(num_problems, int) or \
            not 1 <= num_problems <= 2000:
        raise ValueError(f"num_problems must be an int in [1, 2000], got {num_problems!r}")
    draw = _Draw(seed)
    problems, seen = [], set()
    while len(problems) < num_problems:
        prompt, answer = _problem(draw)
        if prompt not in seen:
            seen.add(prompt)
            problems.append({"prompt": prompt, "answer": str(answer)})
    return problems


def write_jsonl(path, problems: list[dict]) -> None:
    """One JSON object per line, keys in a fixed order."""
    with open(path, "w", encoding="utf-8") as f:
        for problem in problems:
            f.write(json.dumps({"prompt": problem["prompt"], "answer": problem["answer"]})
                    + "\n")

"""What `benchmarks/peers.py` and its peer workers share: the settings, the token ids, the
reward, a plain-Python guess_number for the peers' multi-turn loop, and the JSON-lines
protocol between the driver and a worker.

Standard library only: this module is imported by arl's process and by the TRL and tunix
workers, each of which runs in its own virtual environment without arl or JAX-from-arl.

Protocol (one JSON object per line):
  driver -> worker (stdin):  {"cmd": "step"} | {"cmd": "quit"}
  worker -> driver (stdout): {"event": "ready", ...} once built and warmed up, then one
                             {"event": "step", ...} per "step" command, or
                             {"event": "error", "message": ...} before exiting.
A worker writes protocol lines to a duplicate of its original stdout and points file
descriptor 1 at stderr, so whatever the libraries print cannot corrupt the protocol.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import string
import sys

# Token ids of the single-turn settings (the same on every side).
PAD_ID = 0
BOS_ID = 1  # arl starts its buffer with it; the peers' 8-token prompts have none
EOT_ID = 2  # never sampled as a stop: generation is forced to its full length
TARGET_ID = 3  # reward = share of generated tokens equal to it
FIRST_PROMPT_ID = 4  # prompt tokens are drawn uniformly from [FIRST_PROMPT_ID, vocab)

PROTOCOL_PREFIX = "@@peer "


@dataclasses.dataclass(frozen=True)
class Setting:
    """One equal-work comparison: a Qwen2-shaped policy and a GRPO batch.

    Single-turn (turns == 0): `num_prompts` prompts of `prompt_len` random tokens,
    `group_size` samples each, exactly `gen_len` generated tokens per sample.
    Multi-turn (turns > 0): guess_number (max_n 16) for `turns` turns; each turn the
    policy writes up to `gen_len` tokens (a number and end-of-turn) and the environment
    replies with a word; the vocabulary is arl's CharCodec (`vocab` = 90).
    """

    name: str
    num_layers: int
    d_model: int
    mlp_dim: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    num_prompts: int
    group_size: int
    prompt_len: int
    gen_len: int
    turns: int = 0
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6

    @property
    def batch(self) -> int:
        return self.num_prompts * self.group_size

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Setting":
        return cls(**json.loads(text))


SETTINGS = {
    "toy": Setting("toy", num_layers=2, d_model=128, mlp_dim=256, vocab=64, num_heads=4,
                   num_kv_heads=2, num_prompts=8, group_size=8, prompt_len=8, gen_len=16),
    "modest": Setting("modest", num_layers=4, d_model=256, mlp_dim=1024, vocab=512,
                      num_heads=8, num_kv_heads=4, num_prompts=16, group_size=8,
                      prompt_len=8, gen_len=64),
    # guess_number, 6 turns, toy-sized model over arl's 90-token character vocabulary.
    "multiturn": Setting("multiturn", num_layers=2, d_model=128, mlp_dim=256, vocab=90,
                         num_heads=4, num_kv_heads=2, num_prompts=8, group_size=8,
                         prompt_len=11, gen_len=3, turns=6),
    # The smoke test's size: seconds to compile and run.
    "tiny": Setting("tiny", num_layers=1, d_model=32, mlp_dim=64, vocab=16, num_heads=2,
                    num_kv_heads=1, num_prompts=2, group_size=2, prompt_len=4, gen_len=4),
}


def target_share(generated_ids) -> float:
    """The reward of one sample: the share of its generated tokens equal to TARGET_ID."""
    ids = list(generated_ids)
    return sum(1 for t in ids if int(t) == TARGET_ID) / max(1, len(ids))


# ---------------------------------------------------------------- guess_number on the host
# arl's CharCodec vocabulary, spelled out: 5 special tokens, then these characters.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eot>", "<user>", "<agent>")
CHARACTERS = (string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n"
              + "<>/+-*=().,:;?!_#'\"|%")
CHAR_VOCAB = SPECIAL_TOKENS + tuple(CHARACTERS)
CHAR_IDS = {token: i for i, token in enumerate(CHAR_VOCAB)}
CHAR_EOT_ID = CHAR_IDS["<eot>"]
CHAR_BOS_ID = CHAR_IDS["<bos>"]
GUESS_REPLIES = ("higher", "lower", "correct", "invalid")


def char_encode(text: str) -> list[int]:
    return [CHAR_IDS[c] for c in text]


class GuessNumberHost:
    """arl's `guess_number` (max_n 16) rules in plain Python, one episode per instance.

    The action is the turn's tokens cut at the first end-of-turn; it must be an integer
    (optional leading minus, at most 9 digits) in [0, N). Reply "higher" / "lower" /
    "correct" (the episode ends) / "invalid"; reward success 1.0 - turn cost 0.05 - 0.1
    for an invalid turn; the episode is truncated after `max_turns` turns.
    """

    def __init__(self, hidden: int, max_turns: int, num_values: int = 16):
        self.hidden = hidden
        self.num_values = num_values
        self.max_turns = max_turns
        self.turn = 0
        self.done = False
        self.episode_return = 0.0

    def prompt_ids(self) -> list[int]:
        return [CHAR_BOS_ID] + char_encode(f"guess 0-{self.num_values - 1}")

    def step(self, action_ids) -> list[int]:
        """Plays one turn; returns the reply's token ids."""
        ids = list(action_ids)
        if CHAR_EOT_ID in ids:
            ids = ids[:ids.index(CHAR_EOT_ID)]
        text = "".join(CHAR_VOCAB[i] if 0 <= i < len(CHAR_VOCAB) else "\0" for i in ids)
        digits = text[1:] if text.startswith("-") else text
        valid = 1 <= len(digits) <= 9 and all(c in string.digits for c in digits)
        value = int(text) if valid else 0
        valid = valid and 0 <= value < self.num_values
        correct = valid and value == self.hidden
        reply = ("invalid" if not valid else "correct" if correct
                 else "higher" if self.hidden > value else "lower")
        self.episode_return += (1.0 if correct else 0.0) - 0.05 - (0.0 if valid else 0.1)
        self.turn += 1
        self.done = correct or self.turn >= self.max_turns
        return char_encode(reply)


# ---------------------------------------------------------------------------- protocol
class Channel:
    """The worker's side of the protocol (see the module docstring)."""

    def __init__(self):
        self._out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def send(self, event: str, **fields) -> None:
        self._out.write(PROTOCOL_PREFIX + json.dumps({"event": event, **fields}) + "\n")
        self._out.flush()

    def next_command(self) -> str:
        line = sys.stdin.readline()
        if not line:
            return "quit"
        return json.loads(line).get("cmd", "quit")


def parse_event(line: str):
    """The event dict of a protocol line, or None for any other output."""
    if not line.startswith(PROTOCOL_PREFIX):
        return None
    return json.loads(line[len(PROTOCOL_PREFIX):])


def setting_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated `--settings` of a benchmark, each one of SETTINGS."""
    names = [s for s in text.split(",") if s]
    if not names or any(s not in SETTINGS for s in names):
        parser.error(f"--settings: {text!r}; choose from {sorted(SETTINGS)}")
    return names


def worker_arguments() -> argparse.Namespace:
    """A worker's command line: --setting (a Setting's JSON), --checkpoint, --warmup, --seed."""
    parser = argparse.ArgumentParser()
    for flag in ("--setting", "--checkpoint"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()

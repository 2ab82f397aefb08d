r"""SFT then GRPO on 2-digit `calculator` (a `<calc>a*b</calc>` tool call, then the answer).

A randomly initialised decoder cannot discover the tool-call format by sampling, so the
policy is first behaviour-cloned on the environment's *weak* demonstrator (on its first
turn it skips the tool half the time and answers from "mental arithmetic", which is off
by a random non-zero amount half the time: success 0.75), then trained with GRPO (plus a
small SFT floor, alpha 0.05): RL must learn to always call the tool. The two stages:

    python -m experiments.train --config=configs/grpo_calculator.py --workdir=/tmp/calc
    python -m experiments.learning_stages --config=configs/grpo_calculator.py

(`recipes.warm_start` below sets stage 1, run by both; `learning_stages` also reports the
baselines and the SFT-only policy.)
Measured numbers: docs/learning.md, "Measured results"; test:
tests/test_learning_token_slow.py.

`max_turns = 2` is the oracle's horizon (one tool call, one answer); it keeps the
context short (80 tokens) for this CPU. Scale up: `env.kwargs.max_digits` (up to 4),
`max_turns`, a larger model, more tasks per step, a precomputed demonstration set
(`loss.sft_dataset`, see `arl.rollout.episode_datasets`), and `mesh` for a device slice.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # 100 steps, a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "calculator"
    c.env.kwargs.max_digits = 2
    c.env.kwargs.max_turns = 2
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    recipes.warm_start(c, steps=400)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: GRPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

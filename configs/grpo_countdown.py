r"""SFT then GRPO on `countdown` (TinyZero's Countdown: reach a target with + - * /).

The environment (`arl.envs.tasks.countdown`) shows three numbers in [1, 9] and a target in
[1, 100] ("numbers 3 7 5 target 26"); the agent answers "<answer>7*3+5</answer>", using
every number once (TinyZero's rule), checked in-graph with exact rational
arithmetic. Reward: 1 for the target, 0.1 for a well-formed wrong answer, 0 for a
malformed one; a wrong answer gets feedback ("wrong: 24") and one retry (`max_turns = 2`),
the episode's return is the score of its best answer. Stage 1 behaviour-clones the
environment's weaker demonstrator (a greedy player without search: it combines the
numbers in a random order, each time with the operator that brings it closest to the
target; success 0.52 over two attempts) for 300 steps; stage 2 is 100 steps of GRPO
(8 tasks x 8 samples) with a small SFT floor. The oracle writes the generating
expression (1.0).

Measured (seed 0, shared 2-core CPU at load average ~11, 13 minutes;
`experiments.learning_stages`, success on 256 fresh tasks, sampled / greedy): the
demonstrator succeeds 0.52, the model 0.18 / 0.21 after SFT and 0.32 / 0.37 after
SFT + GRPO (untrained: 0.00). RL improves on SFT (the rollouts' success goes from 0.17
over the first 10 steps to 0.32-0.38 over the last 20) but stays below the demonstrator:
a 2-layer d_model-64 decoder does not learn the demonstrator's arithmetic search in 300
SFT steps.

    python -m experiments.train --config=configs/grpo_countdown.py --workdir=/tmp/countdown
    python -m experiments.learning_stages --config=configs/grpo_countdown.py

Harder tasks: `env.kwargs.max_number=99` (TinyZero's range),
`max_numbers=4`, `env.params.num_numbers=4`. Measured numbers: docs/learning.md,
"Measured results"; test: tests/test_learning_games_slow.py.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "countdown"
    c.env.kwargs.max_numbers = 3
    c.env.kwargs.max_number = 9
    c.env.kwargs.max_target = 100
    c.env.kwargs.max_turns = 2
    c.train_steps = 100
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    recipes.warm_start(c, steps=300, batch=64)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: GRPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

r"""SFT then GRPO on `sokoban` (RAGEN's box pushing on a text grid), without the step penalty.

The environment (`arl.envs.tasks.sokoban`) renders a 5 x 5 room (outer walls included, so a
3 x 3 interior, interior walls with probability 0.1) with one box and its target; a turn
is 1-3 moves ("Up,Left,Left<eot>"), the reply is the grid after them, and the episode
ends after 3 turns. Reward per move: +1 box on target, -1 box off target, +10 solved;
a malformed turn -0.1. Levels are made by a reverse walk of up to 9 moves, so every
level is solvable within the budget; the oracle replays the walk (1.0). Stage 1
behaviour-clones the weaker demonstrator (each oracle move replaced by a random one with
probability 0.4; success 0.73) for 300 steps; stage 2 is 100 steps of GRPO (8 tasks x 8
samples, AdamW 3e-4) with a small SFT floor.

Why `env.params.step_reward = 0` (gym-sokoban's default is -0.1 per move): with one box,
a failed episode's return is -0.1 x its number of moves, so in a group where no sample
solves the level the only difference is how many moves were made, and GRPO's division by
the group's std turns that 0.6 spread into an advantage as large as a success's. With the
penalty the policy drifts to one move per turn (too few to solve 82 % of the levels) and
its success collapses; without it a group with no success carries no signal.

Measured (seed 0, `experiments.learning_stages`, success on 256 fresh levels, sampled /
greedy): the demonstrator solves 0.73, the model 0.18 / 0.43 after SFT and 0.29 / 0.53
after SFT + GRPO (untrained: 0.00); the rollouts' success rises from 0.22 over RL steps
1-10 to ~0.30 over steps 51-100. Seeds 1 and 2 (stage 1 included) start lower and gain
less: 0.12 / 0.21 -> 0.18 / 0.33 and 0.13 / 0.20 -> 0.20 / 0.36. With the step penalty the same recipe ended at 0.05 /
0.07 (docs/learning.md, "Measured results").

    python -m experiments.train --config=configs/grpo_sokoban.py --workdir=/tmp/sokoban
    python -m experiments.learning_stages --config=configs/grpo_sokoban.py

Test: tests/test_learning_games_slow.py.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "sokoban"
    c.env.kwargs.max_size = 5
    c.env.kwargs.max_boxes = 1
    c.env.kwargs.max_turns = 3
    c.env.kwargs.max_actions_per_turn = 3
    c.env.params.step_reward = 0.0  # see the docstring: a move penalty rewards doing less
    c.train_steps = 100
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    recipes.warm_start(c, steps=300, batch=64)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: GRPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

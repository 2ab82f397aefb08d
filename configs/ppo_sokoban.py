r"""SFT then PPO with a critic on `sokoban` (the task of configs/grpo_sokoban.py).

DRAFT: numbers below to be measured.

    python -m experiments.learning_stages --config=configs/ppo_sokoban.py
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "ppo"
    c.env.name = "sokoban"
    c.env.kwargs.max_size = 5
    c.env.kwargs.max_boxes = 1
    c.env.kwargs.max_turns = 3
    c.env.kwargs.max_actions_per_turn = 3
    c.env.params.step_reward = 0.0  # as grpo_sokoban
    c.train_steps = 100
    c.rollout.num_tasks = 64
    c.rollout.group_size = 1  # a critic needs no groups
    c.updates.epochs = 2
    c.updates.minibatches = 2
    c.advantage.gamma = 1.0
    c.advantage.lam = 0.95
    c.advantage.turn_level = True
    c.advantage.turn_gamma = 0.95
    c.advantage.whiten = True
    c.loss.value_coef = 0.5
    recipes.warm_start(c, steps=300, batch=64)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: PPO alone
    return c

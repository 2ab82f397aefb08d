r"""SFT then ERPO on a mixture of Sokoban, Countdown and arithmetic word problems.

DRAFT: numbers below to be measured.

    python -m experiments.learning_stages --config=configs/erpo_games.py
"""

from arl import config as config_lib
from arl.data import word_problems
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "erpo"
    c.env.name = "mixture"
    c.env.members = (
        {"name": "sokoban",  # as configs/grpo_sokoban.py
         "kwargs": {"max_size": 5, "max_boxes": 1, "max_turns": 3,
                    "max_actions_per_turn": 3},
         "params": {"step_reward": 0.0}},
        {"name": "countdown",  # as configs/grpo_countdown.py
         "kwargs": {"max_numbers": 3, "max_number": 9, "max_target": 100, "max_turns": 2}},
        {"name": "dataset_task",  # as configs/grpo_word_problems.py
         "kwargs": {"path": word_problems.SHIPPED_JSONL, "split": "train",
                    "verifier": "numeric", "max_turns": 2}},
    )
    c.advantage.erpo_centre_on_env_mean = False
    c.train_steps = 150
    c.rollout.num_tasks = 12  # four tasks of each member per step
    c.rollout.group_size = 8
    recipes.warm_start(c, steps=900, batch=96)  # stage 1: clone the three demonstrators
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: ERPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

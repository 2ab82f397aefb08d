r"""GRPO on a TextArena single-player game (`textarena:<game>`; pip install
'arl[textarena]').

    python -m experiments.train --config=configs/grpo_textarena.py --workdir=/tmp/ta
    python -m experiments.learning_stages --config=configs/grpo_textarena.py

The environment (`arl.envs.tasks.textarena_game`) plays TextArena's GuessTheNumber-v0,
one game object per episode, here on the range 1..8 with the game's turn limit at 3
(`env.kwargs.game_kwargs`, TextArena's own constructor arguments; arl's `max_turns`
follows the game's limit). Bisection wins 7 of the 8 numbers within 3 guesses; a cut
episode is paid the game's completion reward (1 - distance / range of the last guess).
The prompt (TextArena's 500-character instructions, the same every episode) is cut to
`prompt_len` tokens: the tiny model learns the game from the replies.
Stage 1 clones the game's weaker demonstrator (a number of the range the hints leave,
its midpoint half the time); stage 2 is GRPO with a small SFT floor, as the other
recipes. Measured: docs/environments.md, "TextArena".
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # 100 steps, a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "textarena:GuessTheNumber-v0"
    c.env.kwargs.game_kwargs = {"min_number": 1, "max_number": 8, "max_turns": 3}
    c.env.kwargs.prompt_len = 16
    c.env.kwargs.obs_len = 32
    c.env.kwargs.action_len = 4
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    recipes.warm_start(c, steps=200)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: GRPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

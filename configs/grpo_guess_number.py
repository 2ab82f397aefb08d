r"""SFT then GRPO on `guess_number` (find a hidden integer in [0, 16) from higher/lower
replies, within the default 6 turns).

Stage 1 behaviour-clones the environment's *weaker* demonstrator (half its guesses are a
uniformly random number from the consistent interval instead of the bisection midpoint:
success 0.99 within 6 turns but 3.70 turns on average, against bisection's 3.33); the
model has to learn to track the consistent interval from the replies. Stage 2 is GRPO
(plus a small SFT floor, alpha 0.05) at a low learning rate with warmup: it sharpens the
sampled policy towards bisection (higher sampled success, fewer turns). A higher RL
learning rate (2e-3, fresh Adam) wrecked the SFT policy within 10 steps (sampled success
0.83 -> 0.63) in the measurements.

    python -m experiments.train --config=configs/grpo_guess_number.py --workdir=/tmp/gn
    python -m experiments.learning_stages --config=configs/grpo_guess_number.py

Both run the two stages (`recipes.warm_start` below sets stage 1; `experiments.train` saves
the post-SFT state as checkpoint 0, so a resume skips it); `learning_stages` also
reports the random, demonstrator, oracle and SFT-only baselines.
Measured numbers: docs/learning.md, "Measured results"; test:
tests/test_learning_token_slow.py.

Scale up: `env.kwargs.max_n` (e.g. 100 or 1000: more turns, longer contexts), a wider
and deeper model, `rollout.num_tasks` (more distinct tasks per step) and
`rollout.group_size` (a better group baseline); on a device slice set `mesh` so that
num_tasks * group_size divides over data * fsdp.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # 100 steps, a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "guess_number"
    c.env.kwargs.max_n = 16
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    recipes.warm_start(c, steps=400)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: GRPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

r"""SFT then critic-based PPO on the multi-turn `guess_number` task (a value head on the
decoder), N = 8 (at most 5 turns).

Stage 1 is a short behaviour cloning on the environment's *weaker* demonstrator (half
its guesses are random numbers from the consistent interval), stopped early (100 steps:
sampled success 0.875, 3.09 turns); stage 2 is PPO with no SFT term at all
(`loss.sft_coef = 0`), so every gain after the warm start is the critic-based RL's
(measured: 0.97 sampled, 1.0 greedy, 2.80 turns after 100 PPO steps). From a weaker
40-step warm start (0.68 sampled) the same PPO stage reached only 0.81 in 100 steps.
Turn-level (bi-level) GAE: GAE across turns with `turn_gamma`, then token-level GAE
inside each turn, over agent tokens only (observation tokens of the environment's
replies are skipped); `advantage.turn_level=False` gives plain token-level GAE. One
sample per task is enough for PPO (no group baseline): the critic is the baseline.

    python -m experiments.train --config=configs/ppo_guess_number.py --workdir=/tmp/ppo_gn
    python -m experiments.learning_stages --config=configs/ppo_guess_number.py

(`recipes.warm_start` below sets stage 1, run by both; `learning_stages` also reports the
baselines and the SFT-only policy.)
Measured numbers: docs/learning.md, "Measured results"; test:
tests/test_learning_token_slow.py.

Scale up: as for `grpo_guess_number`; with a larger model, consider value clipping
(`loss.value_clip=0.2`) and more epochs.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # 100 steps, a 2-layer d_model-64 decoder
    c.env.name = "guess_number"
    c.env.kwargs.max_n = 8
    recipes.critic_ppo(c)  # 64 tasks x 1, turn-level GAE, value_coef 0.5
    recipes.warm_start(c, steps=100)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: PPO alone
    return c

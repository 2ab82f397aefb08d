r"""SFT then PPO with a critic on `sokoban` (the task of configs/grpo_sokoban.py).

Same environment and stage 1 as `grpo_sokoban` (5 x 5 room, one box, 3 turns of up to 3
moves, no per-move penalty; 300 steps cloning the weaker demonstrator, success 0.73);
stage 2 is 100 steps of PPO with a value head on the policy instead of GRPO, as
`ppo_countdown`: 64 tasks x 1 sample, 2 epochs x 2 minibatches, turn-level GAE (lam 0.95,
turn_gamma 0.95), whitened advantages, no SFT term, AdamW 3e-4 with 10 warmup steps.

Why `loss.value_coef = 0.05` (ppo_countdown uses 0.5): Sokoban's returns are 0 or ~11
(+1 box on target, +10 solved), Countdown's at most 1, so the critic's squared error is
~100x larger here. At 0.5 the value loss dominates the global-norm clipped gradient of
the shared trunk and PPO *degrades* the SFT policy (0.18 / 0.43 -> 0.12 / 0.26); at
0.05, or at 0.5 with every reward divided by 10, it improves it.

Measured (seed 0, shared 2-core CPU at load average ~5, SFT weights shared with
`grpo_sokoban`; `experiments.learning_stages`, 256 fresh levels, sampled / greedy): the
model 0.18 / 0.43 after SFT and 0.51 / 0.71 after SFT + PPO (GRPO: 0.29 / 0.53); the
rollouts' success rises from 0.18 over RL steps 1-10 to 0.48 over steps 91-100; the
demonstrator stays ahead sampled (0.73). Seed 0 is the best of three: with its own stage
1, seed 1 went from 0.12 / 0.21 to 0.16 / 0.26 and seed 2 from 0.13 / 0.20 to 0.26 / 0.43
(GRPO from the same weights: 0.18 / 0.33 and 0.20 / 0.36).

    python -m experiments.learning_stages --config=configs/ppo_sokoban.py

Measured numbers and curves: docs/learning.md, "Measured results"; test:
tests/test_learning_games_slow.py.
"""

from configs import grpo_sokoban, recipes


def get_config():
    c = grpo_sokoban.get_config()  # env, model, steps and stage 1 of the GRPO config
    recipes.critic_ppo(c, value_coef=0.05)  # returns of ~11: see the docstring
    c.loss.sft_coef = 0.0  # PPO alone: no SFT floor in stage 2
    return c

r"""SFT then PPO with a critic on `countdown` (the task of configs/grpo_countdown.py).

Same environment and stage 1 as `grpo_countdown` (three numbers in [1, 9], targets in
[1, 100], two attempts; 300 steps cloning the greedy demonstrator, success 0.52); stage 2
is 100 steps of PPO with a value head instead of GRPO: 64 tasks x 1 sample, 2 epochs x 2
minibatches, turn-level GAE (lam 0.95, turn_gamma 0.95), whitened advantages, no SFT
term.

Measured (seed 0, shared 2-core CPU at load average 3-5, 4 minutes;
`experiments.learning_stages`, 256 fresh tasks, sampled / greedy): the model 0.18 / 0.21
after SFT (the same stage-1 weights as `grpo_countdown`) and 0.33 / 0.43 after SFT + PPO
(GRPO: 0.32 / 0.37); the rollouts' success goes from 0.16 over the first 10 steps to
0.28 over the last 10; the demonstrator stays ahead (0.52).

    python -m experiments.learning_stages --config=configs/ppo_countdown.py

Measured numbers: docs/learning.md, "Measured results"; test:
tests/test_learning_games_slow.py.
"""

from configs import grpo_countdown, recipes


def get_config():
    c = grpo_countdown.get_config()  # env, model, steps and stage 1 of the GRPO config
    recipes.critic_ppo(c)  # 64 tasks x 1, turn-level GAE, value_coef 0.5
    c.loss.sft_coef = 0.0  # PPO alone: no SFT floor in stage 2
    return c

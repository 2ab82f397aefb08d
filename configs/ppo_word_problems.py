r"""SFT then PPO with a critic on arithmetic word problems from a dataset (the task of
configs/grpo_word_problems.py).

Same environment and stage 1 as `grpo_word_problems` (`dataset_task` on the shipped
problems' training split, numeric verifier, two attempts; 1000 steps cloning the weak
demonstrator, success 0.74); stage 2 is 200 steps of PPO with a value head instead of
GRPO: 64 tasks x 1 sample, 2 epochs x 2 minibatches, turn-level GAE (lam 0.95,
turn_gamma 0.95), whitened advantages, no SFT term. Returns lie in [-0.2, 1], so the
value loss keeps its usual weight (0.5; on Sokoban's ~11-point returns `ppo_sokoban`
needs 0.05).

Measured (seed 0, shared 2-core CPU at load average 3-5, 2 minutes for stage 2 from the
cached stage 1 of `grpo_word_problems`; `learning_stages`, 256 fresh training-split
tasks, sampled / greedy): 0.36 / 0.74 after SFT (the demonstrator 0.74) and 0.86 / 0.91
after SFT + PPO (GRPO with its SFT floor: 0.74 / 0.84); the rollouts' success goes from
0.48 over the first 10 RL steps to 0.87 over the last 10. Held-out problems were not
measured for this run (the GRPO run memorised: ~0.2 there).

    python -m experiments.learning_stages --config=configs/ppo_word_problems.py

Measured numbers: docs/learning.md, "Measured results".
"""

from configs import grpo_word_problems, recipes


def get_config():
    c = grpo_word_problems.get_config()  # env, model and stage 1 of the GRPO config
    recipes.critic_ppo(c)  # 64 tasks x 1, turn-level GAE, value_coef 0.5
    c.loss.sft_coef = 0.0  # PPO alone, as ppo_countdown and ppo_sokoban
    return c

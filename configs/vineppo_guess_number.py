r"""SFT then VinePPO on `guess_number` with a tight turn budget (N = 64, 7 turns =
ceil(log2(65)), the bisection optimum), where a wasted guess early decides the outcome
several turns later.

VinePPO (Kazemnejad et al. 2024) replaces the critic by Monte Carlo values: before turns
2 and 4 of every episode the environment state and the context are forked twice and
played to the end with the current policy, inside the compiled step
(`arl.rollout.branching`); turn k's advantage is r_k + V(s_k+1) - V(s_k), with V(s_0) the
leave-one-out mean return of the task's group. The continuations cost about as many
environment steps as the rollout itself (`mc/env_steps_per_rollout_step`).

    python -m experiments.learning_stages --config=configs/vineppo_guess_number.py

(`c.warm_start` sets stage 1, run by it and by `experiments.train`: behaviour cloning
on the environment's weaker demonstrator first, as docs/learning.md explains.) The comparison
with GRPO, PPO and process rewards at an equal budget of environment steps:
`python -m benchmarks.credit_assignment` (docs/algorithms.md, "Credit assignment inside an
episode").

Scale up: `process.mc_samples` (less noisy values), `process.branch_turns=()` (fork
before every turn), larger `rollout.num_tasks`.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "vineppo"
    c.env.name = "guess_number"
    c.env.kwargs.max_n = 64
    c.env.kwargs.max_turns = 7
    c.train_steps = 60
    c.sample_every = 20
    c.checkpoint_every = 20
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    c.advantage.whiten = True
    c.process.mc_samples = 2  # continuations per branch point
    c.process.branch_turns = (2, 4)
    recipes.warm_start(c, steps=300)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=5)  # stage 2: VinePPO ...
    c.loss.sft_coef = 0.05  # ... with a small SFT floor
    c.loss.sft_source = "demonstrator"
    return c

r"""SFT then VinePPO on `guess_number` with a tight turn budget (N = 64, 7 turns =
ceil(log2(65)), the bisection optimum), where a wasted guess early decides the outcome
several turns later.

VinePPO (Kazemnejad et al. 2024) replaces the critic by Monte Carlo values: before turns
2 and 4 of every episode the environment state and the context are forked twice and
played to the end with the current policy, inside the compiled step
(`arl.branching`); turn k's advantage is r_k + V(s_k+1) - V(s_k), with V(s_0) the
leave-one-out mean return of the task's group. The continuations cost about as many
environment steps as the rollout itself (`mc/env_steps_per_rollout_step`).

    python -m experiments.learning_stages --config=configs/vineppo_guess_number.py

(`c.warm_start` sets stage 1, run by it and by `experiments.train`: behaviour cloning
on the environment's weaker demonstrator first, as DESIGN.md section 7 asks.) The comparison
with GRPO, PPO and process rewards at an equal budget of environment steps:
`python -m benchmarks.credit_assignment` (benchmarks/RESULTS.md, "Credit assignment").

Scale up: `process.mc_samples` (less noisy values), `process.branch_turns=()` (fork
before every turn), larger `rollout.num_tasks`.
"""

from arl import config as config_lib


def get_config():
    c = config_lib.default_config()
    # Stage 1 (arl.warm_start, run by experiments.train and experiments.learning_stages):
    # behaviour cloning on the demonstrator, sft_steps of sft_batch fresh
    # demonstrations each, AdamW at sft_lr; stage 2 (RL) starts from those weights.
    c.warm_start.sft_steps = 300
    c.warm_start.sft_batch = 64
    c.warm_start.sft_lr = 3e-3
    c.algorithm = "vineppo"
    c.env.name = "guess_number"
    c.env.kwargs.max_n = 64
    c.env.kwargs.max_turns = 7
    c.train_steps = 60
    c.log_every = 5
    c.sample_every = 20
    c.checkpoint_every = 20
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.mlp_dim = 256
    c.optim.learning_rate = 3e-4
    c.optim.warmup_steps = 5
    c.advantage.whiten = True
    c.loss.sft_coef = 0.05
    c.loss.sft_source = "demonstrator"
    c.process.mc_samples = 2
    c.process.branch_turns = (2, 4)
    return c

r"""GRPO on a reasoning-gym task (`reasoning_gym:<task>`; pip install 'arl[reasoning-gym]').

    python -m experiments.train --config=configs/grpo_reasoning_gym.py --workdir=/tmp/rg
    python -m experiments.train --config=configs/grpo_reasoning_gym.py --workdir=/tmp/rg2 \
        --config.env.name=reasoning_gym:gcd --config.env.kwargs.task_kwargs={} \
        --config.env.kwargs.action_len=16

The environment (`arl.envs.tasks.reasoning_gym_task`) generates `env.kwargs.size` rows
of the task with `env.kwargs.task_kwargs` (the task's own config fields; here one-digit
sums of two terms) and scores the agent's answer with the task's `score_answer`,
exactly (`env.kwargs.exact=True`: 1 for full credit, else 0; reasoning-gym's partial
credit for answers that contain the oracle's is a reward a policy learns to hack).
Answers are -9..18 (at most three characters), so a turn is at most 4 tokens
(`env.kwargs.action_len`; the adapter's default is 16).
Stage 1 clones the oracle's answers for 200 steps, stopping where about a third of the
sampled answers are right; stage 2 is 200 steps of GRPO alone (no SFT floor: the rise
after stage 1 is then the reward's doing). Measured, and the slow test that holds it:
docs/environments.md, "reasoning-gym".
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "reasoning_gym:chain_sum"
    c.env.kwargs.size = 1000
    c.env.kwargs.seed = 0
    c.env.kwargs.exact = True
    c.env.kwargs.task_kwargs = {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                "max_digits": 1}
    c.env.kwargs.action_len = 4
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    recipes.warm_start(c, steps=200)  # stage 1: clone the oracle ...
    c.loss.sft_source = "oracle"  # ... (the task has no weaker teacher)
    c.train_steps = 200
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: GRPO
    return c

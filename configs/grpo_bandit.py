r"""GRPO from scratch on the RAGEN two-armed bandit (single turn, symbolic arm names).

The smallest token experiment: one turn, an arm name as the action. A random policy
almost never writes a valid arm name, so the curve shows format learning first, then the
choice of the higher-expected-payoff arm ("phoenix" pays 0.15 for sure, "dragon" pays
1.0 with probability 0.25: success = choosing dragon, whose expected payoff is 0.25).

    python -m experiments.train --config=configs/grpo_bandit.py --workdir=/tmp/bandit

Scale up: more tasks per step (`rollout.num_tasks`) and a larger group
(`rollout.group_size`) lower the variance of the group baseline; `env.kwargs.num_pulls`
> 1 turns it into a multi-turn task.
"""

from arl import config as config_lib


def get_config():
    c = config_lib.default_config()
    c.algorithm = "grpo"
    c.env.name = "bandit"
    c.train_steps = 60
    c.log_every = 5
    c.sample_every = 20
    c.checkpoint_every = 20
    c.rollout.num_tasks = 16
    c.rollout.group_size = 8
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.mlp_dim = 256
    c.optim.learning_rate = 1e-3
    c.loss.entropy_coef = 0.0
    return c

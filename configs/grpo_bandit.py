r"""GRPO (RL + alpha*SFT) on the RAGEN two-armed bandit: the default experiment.

One turn, an arm name as the action. The prompt lists two arms in random order: the
low-risk "phoenix" pays 0.15 for sure; the high-risk "dragon" pays 1.0 with probability
`high_prob` (0.5 here, expected payoff 0.5). Success = pulling the arm with the higher
expected payoff.

A randomly initialised transformer never writes "dragon<eot>" by sampling, so the policy
is warm-started with an SFT term on the environment's demonstrator, which pulls the
worse arm half the time (success ~0.47). alpha starts at 1 and decays to 0.05 over 30
steps; after that the curve is RL's: the trained policy pulls dragon ~95% of the time
(greedy: 100%), i.e. it improves on its teacher. Measured on the 2-core CPU: ~100 steps,
a few minutes.

    python -m experiments.train --config=configs/grpo_bandit.py --workdir=runs/bandit

Why high_prob 0.5 rather than RAGEN's 0.25: at 0.25 the gap in expected payoff (0.25 vs
0.15) is small next to the dragon's payoff noise, and at this batch size GRPO drifts into
the low-risk arm (RAGEN's "echo trap"); raise `rollout.group_size` and lower the learning
rate before trying it (`--config.env.params.high_prob=0.25`).

Scale up: more tasks per step (`rollout.num_tasks`) and a larger group
(`rollout.group_size`) lower the variance of the group baseline; `env.kwargs.num_pulls`
> 1 turns it into a multi-turn task.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # 100 steps, a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "bandit"
    c.env.params.high_prob = 0.5
    c.checkpoint_every = 25
    c.rollout.num_tasks = 16
    c.rollout.group_size = 8
    c.optim.learning_rate = 2e-3
    recipes.decaying_sft(c, start=1.0, final=0.05, decay_steps=30)
    return c

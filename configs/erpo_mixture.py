r"""ERPO on a mixture of environments (bandit, guess_number, calculator) in one batch.

Environment-level relative policy optimisation: each trajectory's advantage is its
reward minus its question's (group's) mean, divided by the standard deviation pooled over
all trajectories of its *environment*, so an easy environment's signal is not drowned by
a hard one's. Task i of a step runs member i % 3; metrics are also logged per member
(`success_rate/<i>_<name>`).

Hyperparameters: the lead's measured bandit recipe (RL + alpha*SFT on the environment's
weaker demonstrator, alpha 1.0 decaying to 0.05, constant lr 2e-3) scaled up for a
multi-turn task: d_model 128, train_steps 300, alpha decaying over 150 steps. Not yet
measured to reach 0.9 success on this CPU (at d_model 64 the recipe gave ~0.5 success
after 100 steps on guess_number / calculator).

    python -m experiments.train --config=configs/erpo_mixture.py --workdir=/tmp/mix

Scale up: more members (or difficulty levels of one env as members), `rollout.num_tasks`
a multiple of the number of members, a larger model, `mesh` for a slice.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()
    c.algorithm = "erpo"
    c.env.name = "mixture"
    c.env.members = (
        {"name": "bandit", "kwargs": {}},
        {"name": "guess_number", "kwargs": {"max_n": 8}},
        {"name": "calculator", "kwargs": {"max_digits": 1, "max_turns": 3}},
    )
    c.train_steps = 300
    c.rollout.num_tasks = 12  # four tasks of each member per step
    c.rollout.group_size = 8
    c.model.d_model = 128
    c.model.mlp_dim = 512
    c.optim.learning_rate = 2e-3
    c.advantage.erpo_centre_on_env_mean = False
    recipes.decaying_sft(c, start=1.0, final=0.05, decay_steps=150)
    return c

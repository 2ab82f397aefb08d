"""Shared by the bandit learning tests (tests/test_learning.py, test_learning_reduced.py)."""

import jax
import numpy as np

from arl import rollout as rollout_lib


def bandit_config(algorithm: str):
    """The default experiment's measured recipe (configs/grpo_bandit.py)."""
    import configs.grpo_bandit as grpo_bandit

    c = grpo_bandit.get_config()
    c.algorithm = algorithm
    return c


def demonstrator_success(env, num_tasks: int = 256) -> float:
    """Success rate of the env's (weaker) scripted demonstrator on fresh tasks."""
    traj = rollout_lib.scripted_rollout(env, jax.random.key(7), num_tasks=num_tasks,
                                        group_size=1, action_source="demonstrator")
    return float(np.mean(np.asarray(traj.success)))

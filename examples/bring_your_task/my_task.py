"""The example task's config: tasks.parquet scored by my_rewards.py (docs/bring_your_task.md).

    python make_tasks.py
    PYTHONPATH=.:../.. python -m experiments.train --config=my_task.py --workdir=/tmp/my_task
"""

from arl import config as config_lib


def get_config():
    c = config_lib.default_config()
    c.env.name = "dataset_task"
    c.env.kwargs.path = "tasks.parquet"  # also .jsonl, .csv, a save_to_disk directory
    c.env.kwargs.action_len = 4  # tokens per answer
    c.reward.functions = ("my_rewards:formatted", "my_rewards:correct")
    c.reward.weights = (0.5, 1.0)
    c.reward.env_weight = 0.0  # the functions' rewards only (1.0 adds the verifier's)
    c.rollout.num_tasks, c.rollout.group_size = 8, 8
    c.optim.learning_rate = 3e-3
    c.train_steps = 60
    return c

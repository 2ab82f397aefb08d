"""A tiny GRPO run on `say_digit`, the environment of tests/user_envs.py, which
`config.imports` loads (tests/test_cli.py runs it through the command line)."""

from arl import config as config_lib


def get_config():
    c = config_lib.default_config()
    c.imports = ("tests.user_envs",)
    c.env.name = "say_digit"
    c.train_steps = 2
    c.log_every = 1
    c.checkpoint_every = 1
    c.sample_every = 0
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 16, 1, 32
    c.model.num_heads = c.model.num_kv_heads = 2
    # The SFT term on the oracle's answers keeps the update from being skipped (a random
    # policy rarely says the digit, so GRPO groups are mostly degenerate).
    c.loss.sft_coef, c.loss.sft_source = 0.5, "oracle"
    return c

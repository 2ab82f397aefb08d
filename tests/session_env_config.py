"""A tiny GRPO run on `digit_game`, the stateful environment of tests/session_envs.py
(one `DigitGame` object per episode on the host), loaded by `config.imports`
(tests/test_session_resume.py kills it at random moments and resumes it)."""

from arl import config as config_lib


def get_config():
    c = config_lib.default_config()
    c.imports = ("tests.session_envs",)
    c.env.name = "digit_game"
    c.train_steps = 6
    c.log_every = 1
    c.checkpoint_every = 2
    c.sample_every = 0
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 16, 1, 32
    c.model.num_heads = c.model.num_kv_heads = 2
    c.loss.sft_coef, c.loss.sft_source = 0.5, "oracle"
    return c

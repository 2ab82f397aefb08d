"""Config validation: every bad setting is a one-line ConfigError naming its field."""

from __future__ import annotations

import importlib
import os
import stat

import pytest

from arl import config as config_lib

# (test id, override applied to a default config, field named in the error, num_devices)
_BAD_CONFIGS = [
    ("unknown_algorithm", lambda c: setattr(c, "algorithm", "a2c"), "algorithm", None),
    ("unknown_env", lambda c: setattr(c.env, "name", "chess"), "env.name", None),
    ("gymnax_env_with_token_algorithm",
     lambda c: setattr(c.env, "name", "gymnax:CartPole-v1"), "env.name", None),
    ("vector_algorithm_with_token_env",
     lambda c: setattr(c, "algorithm", "ppo_vector"), "env.name", None),
    ("vector_diagnostics_none",
     lambda c: (setattr(c, "algorithm", "ppo_vector"),
                setattr(c.env, "name", "gymnax:CartPole-v1"),
                setattr(c.vector, "diagnostics", None)), "vector.diagnostics", None),
    ("unknown_mixture_member",
     lambda c: (setattr(c.env, "name", "mixture"),
                setattr(c.env, "members", ({"name": "bandit"}, {"name": "sudoku"}))),
     "env.members[1].name", None),
    ("empty_mixture", lambda c: setattr(c.env, "name", "mixture"), "env.members", None),
    ("group_size_1_for_grpo", lambda c: setattr(c.rollout, "group_size", 1),
     "rollout.group_size", None),
    ("group_size_1_for_erpo",
     lambda c: (setattr(c, "algorithm", "erpo"), setattr(c.rollout, "group_size", 1)),
     "rollout.group_size", None),
    ("batch_not_divisible_by_data_axes",
     lambda c: (setattr(c, "mesh", (3, 1, 1)),), "rollout.num_tasks", 8),
    ("minibatch_not_divisible_by_data_axes",
     lambda c: (setattr(c, "mesh", (4, 1, 1)), setattr(c.updates, "minibatches", 64)),
     "updates.minibatches", 8),
    ("minibatches_do_not_divide_batch", lambda c: setattr(c.updates, "minibatches", 3),
     "updates.minibatches", None),
    ("mesh_larger_than_devices", lambda c: setattr(c, "mesh", (4, 2, 2)), "mesh", 8),
    ("mesh_wrong_rank", lambda c: setattr(c, "mesh", (2, 2)), "mesh", None),
    ("negative_learning_rate", lambda c: setattr(c.optim, "learning_rate", -1e-3),
     "optim.learning_rate", None),
    ("unknown_schedule", lambda c: setattr(c.optim, "schedule", "step"), "optim.schedule",
     None),
    ("clip_low_above_one", lambda c: setattr(c.loss, "clip_low", 1.5), "loss.clip_low", None),
    ("clip_high_zero", lambda c: setattr(c.loss, "clip_high", 0.0), "loss.clip_high", None),
    ("dual_clip_below_one", lambda c: setattr(c.loss, "dual_clip", 0.5), "loss.dual_clip",
     None),
    ("unknown_aggregation", lambda c: setattr(c.loss, "agg", "mean"), "loss.agg", None),
    ("unknown_kl_kind", lambda c: setattr(c.loss, "kl_kind", "k4"), "loss.kl_kind", None),
    ("negative_entropy_coef", lambda c: setattr(c.loss, "entropy_coef", -0.1),
     "loss.entropy_coef", None),
    ("gamma_above_one", lambda c: setattr(c.advantage, "gamma", 1.01), "advantage.gamma",
     None),
    ("top_p_zero", lambda c: setattr(c.rollout, "top_p", 0.0), "rollout.top_p", None),
    ("heads_do_not_divide_width", lambda c: setattr(c.model, "num_heads", 3),
     "model.num_heads", None),
    ("negative_layer_unroll", lambda c: setattr(c.model, "layer_unroll", -1),
     "model.layer_unroll", None),
    ("unknown_attention", lambda c: setattr(c.model, "attention", "flash"),
     "model.attention", None),
    ("zero_attention_block", lambda c: setattr(c.model, "attention_block", 0),
     "model.attention_block", None),
    ("zero_train_steps", lambda c: setattr(c, "train_steps", 0), "train_steps", None),
    ("negative_seed", lambda c: setattr(c, "seed", -1), "seed", None),
    ("negative_sample_every", lambda c: setattr(c, "sample_every", -1), "sample_every", None),
    ("starpo_keep_fraction_zero",
     lambda c: setattr(c.filters, "starpo_keep_fraction", 0.0),
     "filters.starpo_keep_fraction", None),
    ("missing_sft_dataset", lambda c: setattr(c.loss, "sft_dataset", "/nonexistent/demos"),
     "loss.sft_dataset", None),
    ("bad_horizon_rounds", lambda c: setattr(c.rollout, "horizon_rounds", (2, 0)),
     "rollout.horizon_rounds", None),
]


@pytest.mark.parametrize("override,field,num_devices",
                         [case[1:] for case in _BAD_CONFIGS],
                         ids=[case[0] for case in _BAD_CONFIGS])
def test_bad_config_is_a_one_line_error_naming_the_field(override, field, num_devices):
    config = config_lib.default_config()
    override(config)
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.validate(config, num_devices=num_devices)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"config.{field}="), message
    # ... followed by what is allowed.
    assert len(message.split(" is invalid: ", 1)[1]) > 10, message


def test_enough_bad_configs_are_listed():
    assert len(_BAD_CONFIGS) >= 15


def test_unwritable_workdir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):  # running as root: permissions are not enforced
            pytest.skip("permissions are not enforced for this user")
        with pytest.raises(config_lib.ConfigError, match=r"^--workdir=.* is not writable"):
            config_lib.validate(config_lib.default_config(), workdir=str(locked / "run"))
    finally:
        os.chmod(locked, stat.S_IRWXU)


def test_workdir_under_a_file_is_rejected(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(config_lib.ConfigError, match="workdir"):
        config_lib.validate(config_lib.default_config(), workdir=str(blocker / "run"))


def test_default_config_is_valid(tmp_path):
    config_lib.validate(config_lib.default_config(), num_devices=1, workdir=str(tmp_path))


_SHIPPED = ["ppo_cartpole", "grpo_bandit", "grpo_guess_number", "grpo_calculator",
            "erpo_mixture", "ppo_guess_number", "vineppo_guess_number"]


@pytest.mark.parametrize("name", _SHIPPED)
def test_shipped_configs_are_valid_on_one_device(name):
    config = importlib.import_module(f"configs.{name}").get_config()
    config_lib.validate(config, num_devices=1)
    # Every shipped config starts from the defaults: no unknown keys.
    assert set(config.keys()) == set(config_lib.default_config().keys())

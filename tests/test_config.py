"""Config validation: every bad setting is a one-line ConfigError naming its field."""

from __future__ import annotations

import importlib
import json
import os
import stat

import jax
import ml_collections
import pytest

from arl import config as config_lib


def _untyped(section, key, value):
    """Sets a value of another type than the default's (ml_collections refuses that)."""
    with section.ignore_type():
        setattr(section, key, value)


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
    ("clip_high_negative", lambda c: setattr(c.loss, "clip_high", -0.1), "loss.clip_high", None),
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
    ("float16_parameters", lambda c: setattr(c.model, "param_dtype", "float16"),
     "model.param_dtype", None),
    ("remat_not_a_bool", lambda c: _untyped(c.model, "remat", 1), "model.remat", None),
    ("negative_vocab_size", lambda c: setattr(c.model, "vocab_size", -1),
     "model.vocab_size", None),
    ("zero_norm_eps", lambda c: setattr(c.model, "norm_eps", 0.0), "model.norm_eps", None),
    ("activation_sharding_not_a_bool", lambda c: _untyped(c, "activation_sharding", 1),
     "activation_sharding", None),
    ("share_group_prompt_not_a_bool",
     lambda c: _untyped(c.updates, "share_group_prompt", "yes"),
     "updates.share_group_prompt", None),
    ("unknown_minibatch_shuffle", lambda c: setattr(c.updates, "shuffle", "tasks"),
     "updates.shuffle", None),
    ("group_shuffle_with_minibatches_splitting_groups",  # 32 | 128 rows but not 16 tasks
     lambda c: (setattr(c.updates, "shuffle", "groups"), setattr(c.updates, "minibatches", 32)),
     "updates.minibatches", None),
    ("group_shuffle_on_the_vector_trainer",
     lambda c: (setattr(c, "algorithm", "ppo_vector"),
                setattr(c.env, "name", "gymnax:CartPole-v1"),
                setattr(c.updates, "shuffle", "groups")), "updates.shuffle", None),
    ("reuse_rollout_activations_not_a_bool",
     lambda c: _untyped(c.updates, "reuse_rollout_activations", 1),
     "updates.reuse_rollout_activations", None),
    ("reuse_rollout_activations_with_two_epochs",
     lambda c: (setattr(c.updates, "reuse_rollout_activations", True),
                setattr(c.updates, "epochs", 2)), "updates.reuse_rollout_activations", None),
    ("reuse_rollout_activations_with_two_minibatches",
     lambda c: (setattr(c.updates, "reuse_rollout_activations", True),
                setattr(c.updates, "minibatches", 2)),
     "updates.reuse_rollout_activations", None),
    ("reuse_rollout_activations_on_the_vector_trainer",
     lambda c: (setattr(c, "algorithm", "ppo_vector"),
                setattr(c.env, "name", "gymnax:CartPole-v1"),
                setattr(c.updates, "reuse_rollout_activations", True)),
     "updates.reuse_rollout_activations", None),
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
    # Refused since the CLI hardening (accepted before, or failing later with a traceback).
    ("misspelt_key", lambda c: setattr(c, "trian_steps", 10), "trian_steps", None),
    ("misspelt_nested_key", lambda c: setattr(c.optim, "learnig_rate", 0.1),
     "optim.learnig_rate", None),
    ("infinite_learning_rate", lambda c: setattr(c.optim, "learning_rate", float("inf")),
     "optim.learning_rate", None),
    ("nan_learning_rate", lambda c: setattr(c.optim, "learning_rate", float("nan")),
     "optim.learning_rate", None),
    ("infinite_unchecked_number", lambda c: setattr(c.loss, "sft_coef_final", float("-inf")),
     "loss.sft_coef_final", None),
    ("infinite_clip_high", lambda c: setattr(c.loss, "clip_high", float("inf")),
     "loss.clip_high", None),
    ("zero_rope_theta", lambda c: setattr(c.model, "rope_theta", 0.0), "model.rope_theta",
     None),
    ("horizon_beyond_max_turns",
     lambda c: (setattr(c.env.kwargs, "max_n", 8),
                setattr(c.rollout, "horizon_rounds", (2, 6))),  # max_turns = 3 + 2
     "rollout.horizon_rounds", None),
    ("env_param_above_range",
     lambda c: (setattr(c.env, "name", "bandit"), setattr(c.env.params, "high_prob", 1.5)),
     "env.params.high_prob", None),
    ("env_param_infinite",
     lambda c: setattr(c.env.params, "turn_cost", float("inf")), "env.params.turn_cost", None),
    ("env_param_not_an_integer",
     lambda c: setattr(c.env.params, "num_values", 2.5), "env.params.num_values", None),
    ("env_param_beyond_static_bound",
     lambda c: setattr(c.env.params, "num_values", 17), "env.params.num_values", None),
    ("unknown_env_param", lambda c: setattr(c.env.params, "num_value", 8),
     "env.params.num_value", None),
    ("env_constructor_refuses_kwarg", lambda c: setattr(c.env.kwargs, "max_n", 1),
     "env.kwargs", None),
    ("unknown_env_kwarg", lambda c: setattr(c.env.kwargs, "max_nn", 8), "env.kwargs.max_nn",
     None),
    ("mixture_member_constructor_error",
     lambda c: (setattr(c.env, "name", "mixture"),
                setattr(c.env, "members", ({"name": "bandit"},
                                           {"name": "guess_number", "kwargs": {"max_n": 1}}))),
     "env.members[1].kwargs", None),
    ("mixture_member_param_out_of_range",
     lambda c: (setattr(c.env, "name", "mixture"),
                setattr(c.env, "members", ({"name": "bandit", "params": {"high_prob": -0.1}},))),
     "env.members[0].params.high_prob", None),
    ("mixture_with_env_params",
     lambda c: (setattr(c.env, "name", "mixture"), setattr(c.env, "members", ({"name": "bandit"},)),
                setattr(c.env.params, "high_prob", 0.5)),
     "env.params", None),
    ("vector_env_with_params",
     lambda c: (setattr(c, "algorithm", "ppo_vector"),
                setattr(c.env, "name", "gymnax:CartPole-v1"),
                setattr(c.env.params, "gravity", 9.8)), "env.params", None),
    ("unknown_gymnax_id",
     lambda c: (setattr(c, "algorithm", "ppo_vector"),
                setattr(c.env, "name", "gymnax:CartPol-v1")), "env.name", None),
    ("imports_missing_module", lambda c: setattr(c, "imports", ("no_such_pkg.envs",)),
     "imports", None),
    ("sft_term_demonstrator_on_env_without_one",
     lambda c: (setattr(c, "imports", ("tests.user_envs",)),
                setattr(c.env, "name", "say_digit"), setattr(c.loss, "sft_coef", 0.5)),
     "loss.sft_source", None),
    ("warm_start_demonstrator_on_env_without_one",
     lambda c: (setattr(c, "imports", ("tests.user_envs",)),
                setattr(c.env, "name", "say_digit"), setattr(c.warm_start, "sft_steps", 10),
                setattr(c.warm_start, "sft_source", "demonstrator")),
     "warm_start.sft_source", None),
    ("mixture_member_without_demonstrator",
     lambda c: (setattr(c, "imports", ("tests.user_envs",)), setattr(c.env, "name", "mixture"),
                setattr(c.env, "members", ({"name": "bandit"}, {"name": "say_digit"})),
                setattr(c.warm_start, "sft_steps", 10)),
     "loss.sft_source", None),
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
    assert len(_BAD_CONFIGS) >= 50


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
    with pytest.raises(config_lib.ConfigError, match=r"^--workdir=.*/file/run'? cannot be "
                       r"created: .*/file'? is a file"):
        config_lib.validate(config_lib.default_config(), workdir=str(blocker / "run"))


def test_workdir_that_is_a_file_is_named_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(config_lib.ConfigError,
                       match=r"^--workdir=.*/file'? is a file, not a directory"):
        config_lib.validate(config_lib.default_config(), workdir=str(blocker))


@pytest.mark.parametrize("path,suggestion", [
    ("trian_steps", "train_steps"),               # a close sibling
    ("optim.learnig_rate", "optim.learning_rate"),
    ("learning_rate", "optim.learning_rate"),     # the same name in another section
    ("optimm.learning_rate", "optim.learning_rate"),
    ("rollout.horizon_round", "rollout.horizon_rounds"),
])
def test_unknown_key_names_the_closest_valid_key(path, suggestion):
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.check_key_path(path)
    assert str(info.value).startswith(f"config.{path} is invalid: not a config key (did you "
                                      f"mean config.{suggestion}?)"), str(info.value)


def test_unknown_key_without_a_close_one_has_no_suggestion():
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.check_key_path("zzzzzz")
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("path", ["train_steps", "optim.learning_rate", "env.kwargs.max_n",
                                  "env.params.anything", "imports"])
def test_schema_and_free_form_keys_are_known(path):
    config_lib.check_key_path(path)


def test_unknown_key_inside_a_new_section_names_its_leaf():
    config = config_lib.default_config()
    config.optimm = {"learning_rate": 0.1}
    with pytest.raises(config_lib.ConfigError,
                       match=r"^config\.optimm\.learning_rate=0\.1 is invalid: not a config key "
                             r"\(did you mean config\.optim\.learning_rate\?\)"):
        config_lib.validate(config)


def test_stored_config_takes_the_defaults_of_keys_added_since():
    """A checkpoint written before a key existed loads with that key's default; the
    stored values (JSON lists included) win over the defaults."""
    stored = json.loads(config_lib.default_config().to_json_best_effort())
    del stored["model"]["remat"]
    del stored["warm_start"]  # a whole section added later
    stored["mesh"] = [1, 1, 1]
    stored["loss"]["kl_coef"] = 0.25
    stored["env"]["members"] = [{"name": "bandit", "kwargs": {}}]
    config = config_lib.with_defaults(stored)
    assert config.model.remat is False
    assert config.warm_start.sft_steps == 0
    assert config.loss.kl_coef == 0.25 and tuple(config.mesh) == (1, 1, 1)
    assert config.env.members[0]["name"] == "bandit"
    config_lib.check_known_keys(config)


def test_stored_config_with_a_key_no_longer_in_the_schema_is_a_config_error():
    stored = json.loads(config_lib.default_config().to_json_best_effort())
    stored["loss"]["kl_coeff"] = 0.1
    with pytest.raises(config_lib.ConfigError,
                       match=r"^config\.loss\.kl_coeff=0\.1 is invalid: not a config key "
                             r"\(did you mean config\.loss\.kl_coef\?\)"):
        config_lib.with_defaults(stored)


def test_config_missing_a_key_is_a_config_error_naming_it():
    config = config_lib.default_config()
    del config.updates["shuffle"]
    with pytest.raises(config_lib.ConfigError,
                       match=r"^config\.updates\.shuffle is missing: build configs from "
                             r"arl\.config\.default_config\(\)"):
        config_lib.validate(config)


def test_env_params_at_the_range_ends_are_accepted():
    config = config_lib.default_config()
    config.env.name = "bandit"
    for value in (0.0, 1.0):
        config.env.params.high_prob = value
        config_lib.validate(config, num_devices=1)


def test_imports_register_a_user_environment():
    """The module named in config.imports is imported by validate (as the CLI, resume
    and evaluation rely on), after which its env name is valid."""
    import sys

    from arl import envs

    config = config_lib.default_config()
    config.imports = ["tests.user_envs"]  # a list, as read back from a checkpoint's JSON
    config.env.name = "say_digit"
    config.loss.sft_source = "oracle"
    config_lib.validate(config, num_devices=1)
    assert "tests.user_envs" in sys.modules
    assert "say_digit" in envs.registered_names()
    config_lib.validate(config, num_devices=1)  # importing again is harmless


def test_default_config_is_valid(tmp_path):
    config_lib.validate(config_lib.default_config(), num_devices=1, workdir=str(tmp_path))


def _vector(c):
    c.algorithm, c.env.name = "ppo_vector", "gymnax:CartPole-v1"


def _lag(c):
    c.rollout.policy_lag, c.loss.off_policy_correction = 1, "tis"


# (test id, change to a default config, whether the trainer can reuse the rollout's
# activations there, whether "auto" turns the reuse on)
_REUSE_CASES = [
    ("defaults", lambda c: None, True, True),
    ("two_epochs", lambda c: setattr(c.updates, "epochs", 2), False, False),
    ("two_minibatches", lambda c: setattr(c.updates, "minibatches", 2), False, False),
    ("policy_lag", _lag, False, False),
    ("rollout_mesh", lambda c: setattr(c.rollout, "mesh", (1, 1, 1)), False, False),
    ("vector_trainer", _vector, False, False),
    # valid, but the recorded buffers would undo rematerialisation's memory saving
    ("remat", lambda c: setattr(c.model, "remat", True), True, False),
]


@pytest.mark.parametrize("change,valid,auto", [case[1:] for case in _REUSE_CASES],
                         ids=[case[0] for case in _REUSE_CASES])
def test_reuse_rollout_activations_resolves(change, valid, auto):
    """`updates.reuse_rollout_activations`: "auto" (the default) is on exactly where the
    trainer can reuse the activations (and without remat) and is never an error; False
    is off everywhere; True is on where valid and a one-line error naming the field
    elsewhere."""
    config = config_lib.default_config()
    assert config.updates.reuse_rollout_activations == "auto"
    change(config)
    config_lib.validate(config, num_devices=2)
    assert config_lib.reuses_rollout_activations(config) is auto
    config.updates.reuse_rollout_activations = False
    config_lib.validate(config, num_devices=2)
    assert config_lib.reuses_rollout_activations(config) is False
    config.updates.reuse_rollout_activations = True
    if valid:
        config_lib.validate(config, num_devices=2)
        assert config_lib.reuses_rollout_activations(config) is True
    else:
        with pytest.raises(config_lib.ConfigError,
                           match=r"^config\.updates\.reuse_rollout_activations=True is "
                                 r"invalid: .*allowed values are \('auto', False\)\.$"):
            config_lib.validate(config, num_devices=2)


def test_reuse_rollout_activations_from_the_command_line(tmp_path):
    """The training CLI's config flag (experiments/train.py's definition) parses the
    setting's text as the bool or "auto"; a stored config's setting reads back."""
    from absl import flags  # pylint: disable=import-outside-toplevel
    from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                        "grpo_bandit.py")
    for text, want in (("False", False), ("false", False), ("True", True), ("auto", "auto")):
        argv = ["train", f"--config={path}",
                f"--config.updates.reuse_rollout_activations={text}"]
        flag_values = flags.FlagValues()
        config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                        lock_config=False, accept_new_attributes=True,
                                        sys_argv=argv)
        flag_values(argv)
        got = flag_values.config.updates.reuse_rollout_activations
        assert got == want and type(got) is type(want), (text, got)
        stored = json.loads(flag_values.config.to_json())
        assert config_lib.with_defaults(stored).updates.reuse_rollout_activations == want
        assert config_lib.reuses_rollout_activations(flag_values.config) is (want is not False)


_SHIPPED = ["ppo_cartpole", "grpo_bandit", "grpo_guess_number", "grpo_calculator",
            "erpo_mixture", "ppo_guess_number", "vineppo_guess_number", "grpo_word_problems",
            "grpo_sokoban", "grpo_countdown", "ppo_countdown", "ppo_sokoban", "erpo_games",
            "ppo_word_problems"]


@pytest.mark.parametrize("name", _SHIPPED)
def test_shipped_configs_are_valid_on_one_device(name):
    config = importlib.import_module(f"configs.{name}").get_config()
    config_lib.validate(config, num_devices=1)
    # Every shipped config starts from the defaults: no unknown keys.
    assert set(config.keys()) == set(config_lib.default_config().keys())


def test_fresh_model_projection_biases():
    """model.qkv_bias / o_bias / mlp_bias give a fresh model those parameters (Qwen2-shaped
    policies without a checkpoint); they must be booleans."""
    from arl.trainers.policy import Policy

    c = config_lib.default_config()
    c.env.name = "bandit"
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 1, 64
    plain = Policy.from_config(c, vocab_size=64, context_length=16, value_head=False)
    c.model.qkv_bias, c.model.o_bias, c.model.mlp_bias = True, True, True
    biased = Policy.from_config(c, vocab_size=64, context_length=16, value_head=False)
    # Shapes only: an eager init of the model costs seconds of op dispatch.
    layer = jax.eval_shape(biased.init_params, jax.random.key(0))["layers"]
    plain_layer = jax.eval_shape(plain.init_params, jax.random.key(0))["layers"]
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(layer["self_attn"])
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert "bias" in layer["self_attn"][name], name
        assert "bias" not in plain_layer["self_attn"][name]
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert "bias" in layer["mlp"][name], name
    # ml_collections refuses `c.model.qkv_bias = 1`; a section built from a dict does not.
    c.model = ml_collections.ConfigDict({**c.model.to_dict(), "qkv_bias": 1})
    with pytest.raises(config_lib.ConfigError, match=r"config\.model\.qkv_bias=1"):
        config_lib.validate(c)


# ------------------------------------------------- rejections outside `validate`
def _tiny_hf_checkpoint(directory, **config_json_changes):
    """A 1-layer Llama checkpoint for the CharCodec vocabulary (or the `vocab_size`
    given, in its tensors too), with `config.json` fields changed afterwards."""
    import json

    import jax

    from arl.envs import CharCodec
    from arl.models import hf_import, transformer

    model_config = transformer.TransformerConfig(
        vocab_size=config_json_changes.get("vocab_size", CharCodec().vocab_size), d_model=8, num_layers=1, num_heads=2,
        num_kv_heads=2, mlp_dim=16, max_len=64)
    params = transformer.Transformer(model_config).init(
        jax.random.key(0), jax.numpy.zeros((1, 4), jax.numpy.int32))["params"]
    hf_import.save_hf_checkpoint(str(directory), params, model_config)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_json_changes}))
    return str(directory)


def _hf_config(path):
    from arl.envs import CharCodec

    config = config_lib.default_config()
    config.env.name = "bandit"
    config.env.kwargs.codec = CharCodec()  # the checkpoint has no tokenizer.json
    config.model.hf_checkpoint = path
    return config


@pytest.mark.parametrize("changes,match", [
    (dict(vocab_size=10), r"has vocab_size 10 < the env codec's"),
    (dict(hidden_act="gelu"), r"is invalid: config\.json: hidden_act='gelu' is not supported"),
])
def test_hf_config_mismatch_is_a_config_error_naming_the_checkpoint(tmp_path, changes, match):
    from arl.trainers import TokenTrainer

    path = _tiny_hf_checkpoint(tmp_path / "hf", **changes)
    with pytest.raises(config_lib.ConfigError,
                       match=rf"^config\.model\.hf_checkpoint='{path}' .*{match}"):
        TokenTrainer(_hf_config(path))


def test_hf_tensor_mismatch_is_a_config_error_naming_the_checkpoint(tmp_path):
    """config.json claims 2 layers, the tensors hold 1: refused when the config is
    validated (the safetensors headers are read then), before anything is built."""
    from arl.trainers import TokenTrainer

    path = _tiny_hf_checkpoint(tmp_path / "hf", num_hidden_layers=2)
    with pytest.raises(config_lib.ConfigError,
                       match=rf"^config\.model\.hf_checkpoint='{path}' is invalid: .*layers"):
        TokenTrainer(_hf_config(path))


def test_a_config_is_checked_once_per_content(monkeypatch, tmp_path):
    """The CLI, `experiment.run` and the trainer each validate the config they get: the
    checks run once for the same content (and device count), again when it changes."""
    from arl import trainers

    checked = []
    check = config_lib._check  # pylint: disable=protected-access
    monkeypatch.setattr(config_lib, "_check", lambda *a: checked.append(1) or check(*a))
    c = config_lib.default_config()
    c.seed = 7919  # content no other test validated in this process
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.model.d_model, c.model.num_heads, c.model.num_kv_heads, c.model.mlp_dim = 32, 4, 2, 64
    config_lib.validate(c, num_devices=jax.device_count(), workdir=str(tmp_path))  # the CLI
    config_lib.validate(c, num_devices=jax.device_count(), workdir=str(tmp_path))  # run
    trainers.build(c)
    assert len(checked) == 1
    c.rollout.top_k = 3
    config_lib.validate(c, num_devices=jax.device_count())
    assert len(checked) == 2
    c.rollout.top_k = -3  # a changed config is checked: the error still comes
    with pytest.raises(config_lib.ConfigError, match="rollout.top_k"):
        config_lib.validate(c, num_devices=jax.device_count())
    c.rollout.top_k = 3
    open(tmp_path / "file", "w").close()
    with pytest.raises(config_lib.ConfigError, match="workdir"):  # always checked
        config_lib.validate(c, num_devices=jax.device_count(),
                            workdir=str(tmp_path / "file" / "below"))
    assert len(checked) == 3

"""The behaviour-cloning warm start (`config.warm_start`, `arl.trainers.warm_start`): it lowers the
SFT loss, RL starts from (and is anchored to) its weights, `experiment.run` runs it once
per workdir, and its settings are validated."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from arl import config as config_lib
from arl.runs import experiment
from arl.trainers import warm_start
from arl.trainers import TokenTrainer


def _tiny_config(**warm):
    c = config_lib.default_config()
    c.algorithm = "grpo"
    c.env.name = "guess_number"
    c.env.kwargs.max_n = 8
    c.rollout.num_tasks, c.rollout.group_size = 4, 2
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 1, 64
    c.model.num_heads, c.model.num_kv_heads = 2, 2
    c.train_steps, c.log_every, c.sample_every, c.checkpoint_every = 2, 1, 0, 100
    c.loss.kl_coef = 0.01  # a reference policy, so that its start can be checked
    for key, value in warm.items():
        c.warm_start[key] = value
    return c


def _assert_trees_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 a, b)


@pytest.fixture(scope="module")
def trainer():
    return TokenTrainer(_tiny_config())


@pytest.fixture(scope="module")
def sft_params(trainer):
    return warm_start.sft_warm_start(trainer, 5, learning_rate=1e-2, batch_size=16)


def test_sft_lowers_the_loss_on_demonstrations(trainer, sft_params):
    key = jax.random.key(123)
    init = trainer.policy_params(trainer.init_state())
    before = warm_start.demonstration_loss(trainer, init, key)
    after = warm_start.demonstration_loss(trainer, sft_params, key)
    assert np.isfinite(before) and after < before - 0.1, (before, after)


def test_start_state_policy_and_reference_are_copies_of_the_sft_weights(trainer,
                                                                        sft_params):
    expected = jax.tree.map(np.asarray, sft_params)
    state = warm_start.start_state(trainer, jax.tree.map(jax.numpy.copy, sft_params))
    _assert_trees_equal(state.params, expected)
    _assert_trees_equal(state.ref_params, expected)
    assert int(state.step) == 0
    leaf = lambda t: jax.tree.leaves(t)[0]
    assert leaf(state.params).unsafe_buffer_pointer() != \
        leaf(state.ref_params).unsafe_buffer_pointer()
    # train_step donates its state: the reference must survive and stay the SFT policy.
    state, metrics = trainer.train_step(state)
    assert np.isfinite(float(metrics["success_rate"]))
    _assert_trees_equal(state.ref_params, expected)


def test_one_sft_run_serves_ppo_and_the_critic_free_algorithms(trainer, sft_params):
    config = _tiny_config()
    config.algorithm = "ppo"
    ppo_trainer = TokenTrainer(config)
    init = ppo_trainer.init_state()
    initial_head = jax.tree.map(np.asarray, init.params["value_head"])
    state = warm_start.start_state(ppo_trainer, jax.tree.map(jax.numpy.copy, sft_params),
                                   init)
    # The policy is the SFT policy; the critic head (absent from the GRPO run's SFT
    # weights) starts as initialised.
    _assert_trees_equal({k: v for k, v in state.params.items() if k != "value_head"},
                        jax.tree.map(np.asarray, sft_params))
    _assert_trees_equal(state.params["value_head"], initial_head)
    # And PPO's weights (with a head) start a critic-free trainer without it.
    back = warm_start.start_state(trainer, jax.tree.map(np.asarray, state.params))
    assert "value_head" not in back.params
    _assert_trees_equal(back.params, jax.tree.map(np.asarray, sft_params))


@pytest.mark.slow  # one more Trainer compile; LoRA's start state is also covered in tests/test_train_lora.py
def test_under_lora_the_sft_weights_become_the_frozen_base(sft_params):
    config = _tiny_config()
    config.model.lora_rank = 4
    lora_trainer = TokenTrainer(config)
    expected = jax.tree.map(np.asarray, sft_params)
    state = warm_start.start_state(lora_trainer, jax.tree.map(jax.numpy.copy, sft_params))
    _assert_trees_equal(state.base_params, expected)
    assert state.ref_params is None  # the base is the reference
    policy = lora_trainer.policy_params(state)  # adapters start at B = 0
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), y, atol=1e-6),
                 policy, expected)


@pytest.mark.slow  # two experiment runs (~1 CPU-minute); default-suite budget
def test_run_warms_up_once_and_a_resume_does_not_repeat_it(tmp_path, monkeypatch):
    from arl.runs import checkpoint

    calls = []
    original = warm_start.warm_start_state

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(warm_start, "warm_start_state", counting)
    config = _tiny_config(sft_steps=3, sft_batch=8, sft_lr=1e-2)
    config.train_steps = 1
    records = experiment.run(config, str(tmp_path))
    assert [r["step"] for r in records] == [1] and len(calls) == 1
    trainer = TokenTrainer(config)
    with checkpoint.Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [0, 1]  # 0: the post-SFT state
        state0, _ = ckpt.restore(0, trainer.abstract_state())
    assert int(state0.step) == 0
    # The saved start state is the SFT policy (not the init), and its KL reference too.
    fresh = trainer.init_state()
    assert not np.array_equal(np.asarray(jax.tree.leaves(state0.params)[0]),
                              np.asarray(jax.tree.leaves(fresh.params)[0]))
    _assert_trees_equal(state0.ref_params, state0.params)

    # Killed before step 1's checkpoint: the resumed run restores checkpoint 0 and
    # trains from there without a second warm start.
    shutil.rmtree(tmp_path / "checkpoints" / "1")
    config.train_steps = 2
    records = experiment.run(config, str(tmp_path))
    assert [r["step"] for r in records] == [1, 2] and len(calls) == 1


@pytest.mark.parametrize("field,value", [
    ("sft_steps", -1), ("sft_batch", -4), ("sft_lr", -1e-3),
    ("sft_source", "human"),
])
def test_bad_warm_start_settings_name_the_field(field, value):
    config = _tiny_config()
    config.warm_start[field] = value
    with pytest.raises(config_lib.ConfigError, match=f"config.warm_start.{field}="):
        config_lib.validate(config)


def test_vector_envs_have_no_warm_start():
    from configs import ppo_cartpole

    config = ppo_cartpole.get_config()
    config.warm_start.sft_steps = 10
    with pytest.raises(config_lib.ConfigError, match="warm_start.sft_steps"):
        config_lib.validate(config)


def test_defaults_mean_no_warm_start():
    assert warm_start.settings(config_lib.default_config()) == dict(
        steps=0, batch_size=None, learning_rate=None, source=None)

"""arl.rollout.episode_datasets: tfds array_record task sets and demonstrations, without TensorFlow."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

from arl import rollout
from arl.rollout import episode_datasets as datasets
from arl import config as config_lib
from arl.envs import make_env
from arl.trainers import TokenTrainer

_BANDIT = {"name": "bandit", "kwargs": {}}
_MIXTURE = {"name": "mixture", "kwargs": {},
            "members": [{"name": "bandit", "kwargs": {}},
                        {"name": "guess_number", "kwargs": {"max_n": 8}}]}


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    return datasets.build_demonstrations(tmp_path_factory.mktemp("demos"), _BANDIT,
                                         num_episodes=10, seed=7, action_source="oracle",
                                         chunk_size=4)


def test_no_tensorflow_is_imported(demo_path):
    datasets.load_demonstrations(demo_path)
    assert "tensorflow" not in sys.modules


def test_demonstrations_equal_the_scripted_rollouts(demo_path):
    demos = datasets.load_demonstrations(demo_path, env_config=_BANDIT)
    env = make_env(config_lib.default_config().env.__class__(_BANDIT))
    assert demos.tokens.shape == (10, rollout.context_length(env))
    # Episodes 0-3 are chunk 0, 4-7 chunk 1, 8-9 the first rows of chunk 2.
    for chunk, rows in [(0, slice(0, 4)), (1, slice(4, 8)), (2, slice(8, 10))]:
        expected = rollout.scripted_rollout(
            env, jax.random.fold_in(jax.random.key(7), chunk), num_tasks=4, group_size=1,
            action_source="oracle")
        count = rows.stop - rows.start
        np.testing.assert_array_equal(demos.tokens[rows], expected.tokens[:count])
        np.testing.assert_array_equal(demos.agent_mask[rows], expected.agent_mask[:count])
        np.testing.assert_array_equal(demos.episode_return[rows],
                                      expected.episode_return[:count])
    assert bool(np.all(demos.success))  # the oracle always picks the better arm
    assert demos.agent_mask.dtype == np.float32 and float(demos.agent_mask.sum()) > 0


def test_env_params_overrides_reach_the_demonstrations(tmp_path):
    # By default (high_prob 0.25) the best arm is dragon; under 0.1 it is phoenix.
    for high_prob, best in [(0.1, "phoenix")]:
        env_config = {"name": "bandit", "params": {"high_prob": high_prob}}
        path = datasets.build_demonstrations(tmp_path / str(high_prob), env_config,
                                             num_episodes=4, action_source="oracle")
        demos = datasets.load_demonstrations(path, env_config=env_config)
        env = make_env(config_lib.default_config().env.__class__(_BANDIT))
        for row in range(4):
            agent_tokens = np.asarray(demos.tokens[row])[np.asarray(demos.agent_mask[row]) > 0]
            assert env.codec.decode(agent_tokens) == f"{best}<eot>"
        tasks = datasets.load_task_set(
            datasets.build_task_set(tmp_path / f"t{high_prob}", env_config, num_tasks=2),
            env_config=env_config)
        np.testing.assert_allclose(tasks.env_params(env).high_prob, [high_prob] * 2)


def test_sample_demonstrations_is_jittable_and_draws_stored_rows(demo_path):
    demos = datasets.load_demonstrations(demo_path)
    sample = jax.jit(datasets.sample_demonstrations, static_argnums=2)(
        demos, jax.random.key(0), 16)
    assert sample.tokens.shape == (16, demos.tokens.shape[1])
    stored = {tuple(row) for row in np.asarray(demos.tokens)}
    assert all(tuple(row) in stored for row in np.asarray(sample.tokens))


def test_load_checks_env_and_context_length(demo_path):
    with pytest.raises(ValueError, match="was built for env"):
        datasets.load_demonstrations(demo_path, env_config={"name": "guess_number"})
    with pytest.raises(ValueError, match="context length"):
        datasets.load_demonstrations(demo_path, context_length=3)
    with pytest.raises(FileNotFoundError, match="no dataset directory"):
        datasets.load_demonstrations(demo_path + "_missing")


def test_rebuilding_a_different_set_in_the_same_dir_is_refused(demo_path, tmp_path):
    data_dir = demo_path.split("/arl_demonstrations/")[0]
    same = datasets.build_demonstrations(data_dir, _BANDIT, num_episodes=10, seed=7,
                                         action_source="oracle", chunk_size=4)
    assert same == demo_path
    with pytest.raises(ValueError, match="already holds a different dataset"):
        datasets.build_demonstrations(data_dir, _BANDIT, num_episodes=10, seed=8)
    with pytest.raises(ValueError, match="action_source"):
        datasets.build_demonstrations(tmp_path, _BANDIT, num_episodes=2, action_source="x")


def test_task_set_replays_the_same_tasks(tmp_path):
    path = datasets.build_task_set(tmp_path, _MIXTURE, num_tasks=6, seed=3)
    tasks = datasets.load_task_set(path, env_config=_MIXTURE)
    np.testing.assert_array_equal(tasks.env_ids, [0, 1, 0, 1, 0, 1])
    env = make_env(config_lib.default_config().env.__class__(_MIXTURE))
    # Two rollouts with different keys but the stored reset keys see the same prompts.
    play = jax.jit(lambda key: rollout.rollout(
        env, key, num_tasks=6, group_size=1, action_source="oracle",
        reset_keys=tasks.reset_keys, env_params=tasks.env_params(env)))
    for key in (0, 1):
        traj = play(jax.random.key(key))
        written = np.asarray(tasks.prompts) != env.codec.pad_id  # prompts are padded
        assert written.sum(axis=1).min() > 0
        np.testing.assert_array_equal(
            np.asarray(traj.tokens[:, 1:1 + env.prompt_len])[written],
            np.asarray(tasks.prompts)[written])
        np.testing.assert_array_equal(traj.env_ids, tasks.env_ids)
    prompts = {env.codec.decode(np.asarray(p)) for p in tasks.prompts}
    assert any(p.startswith("arms:") for p in prompts)
    assert any(p.startswith("guess 0-7") for p in prompts)


@pytest.mark.slow  # a full train-step compile; default suite budget
def test_sft_term_consumes_a_stored_set(demo_path):
    c = config_lib.default_config()
    c.env.name = "bandit"
    c.rollout.num_tasks, c.rollout.group_size = 4, 2
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 1, 64
    c.model.num_heads = c.model.num_kv_heads = 2
    c.loss.sft_coef = 1.0
    c.loss.sft_dataset = demo_path
    trainer = TokenTrainer(c)
    assert trainer.demonstrations is not None
    state = trainer.init_state()
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = trainer.train_step(state)
    metrics = jax.device_get(metrics)
    assert metrics["demo_success_rate"] == 1.0  # oracle episodes from the stored set
    assert np.isfinite(metrics["loss/sft"]) and metrics["loss/sft"] > 0
    # Random tokens never name an arm, so GRPO alone would skip; SFT moves the params.
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before,
                           state.params)
    assert any(jax.tree.leaves(changed))


def test_another_envs_demonstrations_are_a_config_error(demo_path):
    config = config_lib.default_config()  # guess_number; the set holds bandit episodes
    config.loss.sft_coef, config.loss.sft_dataset = 0.5, str(demo_path)
    with pytest.raises(config_lib.ConfigError,
                       match=r"^config\.loss\.sft_dataset='.*' is invalid: dataset .* was "
                             r"built for env"):
        TokenTrainer(config)

"""The single compiled train step: one program, skipping, sharding, bad settings."""

import jax
import numpy as np
import pytest

from arl import config as config_lib
from arl import sharding as sharding_lib
from arl.trainers import TokenTrainer


def tiny_config(algorithm="grpo", env="guess_number", **env_kwargs):
    c = config_lib.default_config()
    c.algorithm = algorithm
    c.env.name = env
    if env == "guess_number" and not env_kwargs:
        env_kwargs = {"max_n": 8}
    c.env.kwargs = env_kwargs
    c.rollout.num_tasks = 4
    c.rollout.group_size = 4
    c.model.d_model = 32
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 64
    c.train_steps = 10
    return c


def _params_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def grpo_trainer():
    c = tiny_config()
    # Near-greedy sampling: the rows of a group (same task, deterministic env) write the
    # same turns, so every group has zero reward variance and zero advantages.
    c.rollout.temperature = 1e-3
    return TokenTrainer(c)


@pytest.fixture(scope="module")
def fresh_state(grpo_trainer):
    """`grpo_trainer.init_state()` as a function: computed once (init_state compiles its
    program at every call), each call a copy on the trainer's devices (the step donates
    the state)."""
    initial = grpo_trainer.init_state()
    shardings = grpo_trainer.state_shardings()
    return lambda: jax.device_put(initial, shardings, may_alias=False)


def test_step_is_one_program_without_host_transfers(grpo_trainer, fresh_state):
    state = fresh_state()
    state, _ = grpo_trainer.train_step(state)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        state, metrics = grpo_trainer.train_step(state)
        state, metrics = grpo_trainer.train_step(state)
    assert int(state.step) == 3
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_the_rollout_method_is_the_step_rollout(grpo_trainer, fresh_state, monkeypatch):
    """Benchmarks time `TokenTrainer.rollout` as the step's rollout: the step plays its
    episodes through it, once, and it prefills a group's prompt once, which plays the
    same episodes as prefilling every row."""
    from arl import rollout as rollout_lib
    state = fresh_state()
    trainer_type, original = type(grpo_trainer), type(grpo_trainer).rollout
    calls = []
    monkeypatch.setattr(trainer_type, "rollout",
                        lambda self, *args: calls.append(args) or original(self, *args))
    jax.eval_shape(lambda s: grpo_trainer.step(s), state)  # a new function: traced anew
    assert len(calls) == 1
    monkeypatch.setattr(trainer_type, "rollout", original)

    played, shared = rollout_lib.rollout, []
    monkeypatch.setattr(rollout_lib, "rollout", lambda *args, **kwargs: shared.append(
        kwargs["share_group_prefill"]) or played(*args, **kwargs))
    c = grpo_trainer.config
    policy = grpo_trainer.policy_params(state)
    key, horizon = jax.random.key(4), grpo_trainer.horizon(0)
    traj = jax.jit(grpo_trainer.rollout)(policy, key, horizon)
    assert shared == [True]
    per_row = jax.jit(lambda p, k: played(
        grpo_trainer.env, k, num_tasks=c.rollout.num_tasks, group_size=c.rollout.group_size,
        model=grpo_trainer.model, params=p, sampling=grpo_trainer.sampling, horizon=horizon,
        env_params=grpo_trainer.task_params(c.rollout.num_tasks, c.rollout.group_size),
        share_group_prefill=False))(policy, key)
    np.testing.assert_array_equal(traj.tokens, per_row.tokens)
    # One prefill per group sums the prompt's attention in another order than one per
    # row: float32 log-probs near 0 differ by a few of the logits' ulps (1.2e-5 measured
    # on AMD family 25), while a different episode would differ by far more.
    np.testing.assert_allclose(traj.behaviour_logp, per_row.behaviour_logp, atol=5e-5)


def test_update_is_skipped_exactly_when_no_advantage_is_nonzero(grpo_trainer, fresh_state):
    state = fresh_state()
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = grpo_trainer.train_step(state)
    assert float(metrics["degenerate_group_fraction"]) == 1.0
    assert float(metrics["update_skipped"]) == 1.0
    assert _params_equal(before, state.params)
    assert int(state.step) == 1


def test_metrics_cover_the_issue_list(grpo_trainer, fresh_state):
    state = fresh_state()
    _, metrics = grpo_trainer.train_step(state)
    for key in ("reward_mean", "reward_std", "success_rate", "turns_mean",
                "response_tokens_mean", "entropy", "policy/clip_fraction_low",
                "policy/clip_fraction_high", "grad_norm", "degenerate_group_fraction",
                "within_group_reward_std", "update_skipped"):
        assert key in metrics, key


# Slow: the default suite trains each of these algorithms for 60 steps in
# tests/test_learning.py, which checks more than a changed parameter.
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "rloo", "reinforce_pp", "drgrpo"])
def test_every_algorithm_updates_the_policy(algorithm):
    c = tiny_config(algorithm, env="bandit")
    c.loss.sft_coef = 0.5  # demonstrations make the untrained policy's update non-trivial
    c.filters.skip_zero_advantage = False
    trainer = TokenTrainer(c)
    state = trainer.init_state()
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = trainer.train_step(state)
    assert not _params_equal(before, state.params)
    assert float(metrics["update_skipped"]) == 0.0
    assert np.isfinite(float(metrics["loss/total"]))
    if algorithm == "ppo":
        assert "value/explained_variance" in metrics


def _run_steps(config, mesh_shape, steps=2):
    mesh = sharding_lib.make_mesh(mesh_shape)
    trainer = TokenTrainer(config, mesh=mesh)
    state = trainer.init_state()
    history = []
    for _ in range(steps):
        state, metrics = trainer.train_step(state)
        history.append(jax.device_get(metrics))
    return jax.device_get(state.params), history


def _sharding_config(mesh_shape):
    c = tiny_config("grpo", env="bandit")
    c.rollout.num_tasks = 8
    c.rollout.group_size = 2
    c.loss.sft_coef = 0.5
    c.mesh = mesh_shape
    return c


@pytest.fixture(scope="module")
def single_device_run():
    """Two steps on one device: the reference of every sharded run (computed once)."""
    return _run_steps(_sharding_config((1, 1, 1)), (1, 1, 1))


@pytest.mark.parametrize("mesh_shape", [
    # The default suite runs (2, 2, 2), which shards the batch and the parameters over all
    # three axes at once; the others are slow (default-suite budget).
    pytest.param((8, 1, 1), marks=pytest.mark.slow), (2, 2, 2),
    pytest.param((1, 4, 2), marks=pytest.mark.slow),
])
def test_sharded_step_equals_single_device(mesh_shape, single_device_run):
    sharded_params, sharded = _run_steps(_sharding_config(mesh_shape), mesh_shape)
    params, single = single_device_run
    for got, want in zip(sharded, single):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
    # atol: two Adam steps of ~1e-3 each; 1e-5 is 1% of one update (Adam's m/sqrt(v)
    # amplifies the float32 reduction-order noise of near-zero gradients).
    for got, want in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("field,value,match", [
    ("algorithm", "a2c", "config.algorithm"),
    ("rollout.group_size", 1, "config.rollout.group_size"),
    ("rollout.num_tasks", 3, "divisible"),
    ("mesh", (4, 4, 1), "devices"),
])
def test_inconsistent_settings_are_rejected_before_tracing(field, value, match):
    c = tiny_config()
    c.mesh = (8, 1, 1)
    node = c
    *parents, leaf = field.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(config_lib.ConfigError, match=match):
        TokenTrainer(c)

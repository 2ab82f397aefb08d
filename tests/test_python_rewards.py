"""Python reward functions inside the compiled step (`arl.trainers.python_rewards`): the
weighted total lands on each episode's last turn end (NumPy reference), the env's reward
is scaled by `reward.env_weight`, per-function metrics, the config's checks, and a
failing function ending a run with one line through the command line."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arl
from arl.rewards.functions import RewardFunctions
from arl.errors import ConfigError
from arl.rollout.rollouts import scripted_rollout
from arl.trainers.python_rewards import PythonRewards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def env_and_traj():
    env = arl.make_env({"name": "dataset_task", "kwargs": {"max_turns": 2}})
    traj = scripted_rollout(env, jax.random.key(3), num_tasks=8, group_size=1,
                            action_source="demonstrator")
    return env, traj


def test_total_lands_on_the_last_turn_end_under_jit(env_and_traj):
    env, traj = env_and_traj
    scorer = RewardFunctions(["tests.user_rewards:length", "tests.user_rewards:nan_on_y"],
                             weights=[0.5, -2.0])
    rewards = PythonRewards(env, scorer, env_weight=0.25)
    out, metrics = jax.jit(rewards)(traj)

    # NumPy reference from the host scores of the same rows.
    lengths = np.zeros(8)
    for b in range(8):
        agent = np.asarray(traj.agent_mask[b]) > 0
        ends = np.flatnonzero(np.asarray(traj.turn_end_mask[b]) > 0)
        last = ends[-1]
        start = last
        while start > 0 and agent[start - 1]:
            start -= 1
        ids = np.asarray(traj.tokens[b, start:last + 1])
        text = env.codec.decode(ids[:-1] if ids[-1] == env.codec.eot_id else ids,
                                stop_at_pad=False)
        lengths[b] = len(text)
    total = 0.5 * lengths - 2.0 * 1.0  # demonstrator answers hold no "y"
    expected = 0.25 * np.asarray(traj.rewards)
    for b in range(8):
        expected[b, np.flatnonzero(np.asarray(traj.turn_end_mask[b]))[-1]] += total[b]
    np.testing.assert_allclose(out.rewards, expected, rtol=1e-6)
    np.testing.assert_allclose(out.episode_return, 0.25 * np.asarray(traj.episode_return)
                               + total, rtol=1e-6)
    np.testing.assert_allclose(out.rewards.sum(1), out.episode_return, rtol=1e-5, atol=1e-6)
    turns = np.asarray(traj.num_turns)
    np.testing.assert_allclose(
        out.turn_rewards, 0.25 * np.asarray(traj.turn_rewards)
        + (np.arange(2)[None] == turns[:, None] - 1) * total[:, None], rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/length/mean"], lengths.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/length/std"], lengths.std(), rtol=1e-5)
    assert float(metrics["reward/nan_on_y/mean"]) == 1.0
    assert float(metrics["reward/nan_on_y/std"]) == 0.0
    assert float(metrics["reward/length/errors"]) == 0.0


def test_unscored_rows_leave_the_statistics(env_and_traj):
    env, traj = env_and_traj
    scorer = RewardFunctions(["tests.user_rewards:length"])
    rewards = PythonRewards(env, scorer)
    values = np.array([1.0, np.nan, 3.0, np.nan, 5.0, 7.0, np.nan, 2.0], np.float32)
    rewards.host_scores = lambda *args: (values[:, None], np.zeros((1,), np.int32))
    out, metrics = jax.jit(rewards)(traj)
    scored = values[~np.isnan(values)]
    np.testing.assert_allclose(metrics["reward/length/mean"], scored.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/length/std"], scored.std(), rtol=1e-6)
    np.testing.assert_allclose(out.episode_return - traj.episode_return,
                               np.nan_to_num(values), rtol=1e-6)
    assert np.all(np.isfinite(out.rewards))


@pytest.mark.parametrize("field,value,message", [
    ("functions", ("tests.user_rewards",), "expected 'module:function'"),
    ("functions", ("tests.user_rewards:missing",), "has no 'missing'"),
    ("functions", ("tests.user_rewards:length", "tests.user_rewards:length"),
     "share a name"),
    ("weights", (1.0, 2.0), "expected \\(\\) or 1 finite numbers"),
    ("on_error", "skip", "allowed values are \\('raise', 'zero'\\)"),
    ("timeout_s", 0.0, "must be > 0.0"),
])
def test_config_checks_name_the_field(field, value, message):
    c = arl.default_config()
    c.env.name = "dataset_task"
    if field != "functions":
        c.reward.functions = ("tests.user_rewards:length",)
    setattr(c.reward, field, value)
    with pytest.raises(ConfigError, match=f"^config.reward.{field}=.*{message}"):
        arl.validate(c)


@pytest.mark.slow
def test_train_ends_with_one_line_when_a_reward_function_fails(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=configs/grpo_word_problems.py",
         "--config.warm_start.sft_steps=0", "--config.loss.sft_coef=0",
         "--config.train_steps=2", "--config.model.num_layers=1",
         "--config.reward.functions=tests.user_rewards:too_few", f"--workdir={workdir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("experiments.train: error: reward function "
                                "'tests.user_rewards:too_few' returned list of length 63"), \
        lines[-3:]

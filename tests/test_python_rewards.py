"""Python reward functions inside the compiled step (`arl.trainers.python_rewards`): the
weighted total lands on each episode's last turn end (NumPy reference), the env's reward
is scaled by `reward.env_weight`, per-function metrics, the config's checks, and a
failing function ending a run with one line through the command line."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import arl
from arl.rewards.functions import RewardFunctions, episodes
from arl.errors import ConfigError, RewardFunctionError
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


def test_failed_rows_stay_out_of_the_mean_and_are_counted_apart(env_and_traj):
    """on_error="zero": a row the function failed on scores 0 in the total but is not in
    reward/<name>/mean or std (which cover the rows it scored); errors counts it."""
    env, traj = env_and_traj
    scorer = RewardFunctions(["tests.user_rewards:length_nan_on_odd"], on_error="zero")
    out, metrics = jax.jit(PythonRewards(env, scorer))(traj)
    completions = episodes(env, traj.tokens, traj.agent_mask, traj.length,
                           traj.task_rows).completions
    lengths = np.array([len(c) for c in completions], np.float64)
    odd = lengths % 2 == 1
    assert 0 < odd.sum() < len(odd), lengths  # both kinds of rows in the batch
    np.testing.assert_allclose(metrics["reward/length_nan_on_odd/mean"],
                               lengths[~odd].mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/length_nan_on_odd/std"],
                               lengths[~odd].std(), rtol=1e-5)
    assert float(metrics["reward/length_nan_on_odd/errors"]) == odd.sum()
    np.testing.assert_allclose(out.episode_return - traj.episode_return,
                               np.where(odd, 0.0, lengths), rtol=1e-6)


def test_a_failure_inside_the_step_logs_no_jax_traceback(env_and_traj, caplog):
    """The function's error leaves the compiled step as JAX's runtime error, its one
    line in the message; JAX's own "jax.io_callback failed" record (a traceback) is
    dropped for it, but kept for any other exception of a callback."""
    env, traj = env_and_traj
    rewards = PythonRewards(env, RewardFunctions(["tests.user_rewards:raises_always"]))
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(Exception, match="the scoring service is down") as error:
            jax.block_until_ready(jax.jit(rewards)(traj))
    assert not isinstance(error.value, RewardFunctionError)  # JAX's, with the line inside
    assert [r for r in caplog.records if r.name == "jax._src.callback"] == []
    assert rewards.scorer.failure.startswith(
        "reward function 'tests.user_rewards:raises_always' raised RuntimeError: the "
        f"scoring service is down on dataset row {int(traj.task_rows[0])}, prompt '")

    def bug(x):
        raise KeyError("a bug")

    with caplog.at_level(logging.DEBUG):
        with pytest.raises(Exception, match="a bug"):
            jax.block_until_ready(jax.jit(lambda x: io_callback(
                bug, jax.ShapeDtypeStruct((), jnp.float32), x, ordered=True))(1.0))
    assert [r.getMessage() for r in caplog.records if r.name == "jax._src.callback"] == \
        ["jax.io_callback failed"]


def test_transcripts_show_every_reward_term(env_and_traj):
    """The evaluation transcript's extra line: the env's return and each function's
    score with its weight, and their weighted total (what the train step adds)."""
    import types

    from arl.trainers.reward_terms import reward_terms_lines

    env, traj = env_and_traj
    config = arl.default_config()
    config.reward.env_weight = 0.5
    scorer = RewardFunctions(["tests.user_rewards:length", "tests.user_rewards:nan_on_y"],
                             weights=[0.25, 2.0])
    trainer = types.SimpleNamespace(config=config, env=env, reward_model=None,
                                    python_rewards=PythonRewards(env, scorer, 0.5))
    lines = reward_terms_lines(trainer, None, traj)
    out, _ = jax.jit(trainer.python_rewards)(traj)
    completions = episodes(env, traj.tokens, traj.agent_mask, traj.length,
                           traj.task_rows).completions
    for b, line in enumerate(lines):
        env_return = float(traj.episode_return[b])
        assert line == (f"-- reward terms: env {env_return:+.3f} x 0.5, length "
                        f"{len(completions[b]):+.3f} x 0.25, nan_on_y +1.000 x 2 = "
                        f"{float(out.episode_return[b]):+.3f}")
    trainer.python_rewards = None
    assert reward_terms_lines(trainer, None, traj) is None  # the env's reward alone


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

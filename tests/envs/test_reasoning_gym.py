"""`reasoning_gym:<task>` against the real package (the `reasoning_gym` extra; these
tests skip, saying so, without it): rows from the config, the task's `score_answer` as
the reward (exact by default: the substring credit a policy learned to hack is gone),
its answer as the oracle, and a tiny GRPO run through the command line from one config
line."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import arl
from arl import rollout as rollout_lib
from arl.errors import ConfigError

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason="reasoning-gym is not installed (pip install 'arl[reasoning-gym]')")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _env(**kwargs):
    return arl.make_env({"name": "reasoning_gym:chain_sum",
                         "kwargs": {"size": 16, "seed": 3, "task_kwargs": _SUMS, **kwargs}})


def _answers(env, texts, seed=0):
    """Rewards, success and the rows played when each row answers texts[row]."""
    from arl.envs.base import TokenChunk
    from arl.envs.host import _seed_int

    n = len(texts)
    keys = jax.random.split(jax.random.key(seed), n)
    params = arl.envs.broadcast_params(env.default_params(), n)
    state, _ = jax.vmap(env.reset)(keys, params)
    rows = [env.make_task(_seed_int(state.seed[b]), None) for b in range(n)]
    texts = [t(row) if callable(t) else t for t, row in zip(texts, rows)]
    ids = np.full((n, env.action_len), env.codec.pad_id, np.int32)
    lengths = np.zeros((n,), np.int32)
    for b, text in enumerate(texts):
        encoded = env.codec.encode(text)
        ids[b, :len(encoded)], lengths[b] = encoded, len(encoded)
    _, ts = jax.vmap(env.step)(keys, state, TokenChunk(ids, lengths), params)
    return np.asarray(ts.reward), np.asarray(ts.info["success"]), rows


def test_rows_are_the_tasks_generated_from_the_config():
    env = _env()
    expected = reasoning_gym.create_dataset("chain_sum", size=16, seed=3, **_SUMS)
    assert [r["question"] for r in env.rows] == [expected[i]["question"] for i in range(16)]
    assert env.name == "reasoning_gym:chain_sum" and env.max_turns == 1


def test_exact_scoring_refuses_the_substring_credit():
    """The hack: an answer holding the oracle answer gets len(oracle)/len(answer) from the
    default scorer. Exact scoring gives it 0; the oracle's answer gets 1 either way."""
    hack = lambda row: row["answer"] * 4  # e.g. "7777" for "7"
    right = lambda row: row["answer"]
    for exact in (True, False):
        env = _env(exact=exact)
        reward, success, rows = _answers(env, [right, hack, "x"])
        partial = len(rows[1]["answer"]) / len(hack(rows[1]))
        np.testing.assert_allclose(reward, [1.0, 0.0 if exact else partial, 0.0])
        np.testing.assert_array_equal(success, [True, False, False])


def test_the_oracle_solves_every_row():
    env = _env()
    traj = rollout_lib.scripted_rollout(env, jax.random.key(0), num_tasks=8, group_size=1,
                                        action_source="oracle")
    assert bool(traj.success.all()) and float(traj.episode_return.mean()) == 1.0


def test_task_kwargs_the_task_refuses_are_one_line():
    c = arl.default_config()
    c.env.name = "reasoning_gym:gcd"
    c.env.kwargs.task_kwargs = {"min_terms": 2}
    with pytest.raises(ConfigError, match=r"(?s)^config.env.kwargs=.* is invalid: env "
                                          r"'reasoning_gym:gcd' refused them: reasoning-gym's "
                                          r"'gcd' refused task_kwargs=\{'min_terms': 2\}: "):
        arl.validate(c)


def test_a_misspelt_task_is_one_line_naming_the_closest():
    c = arl.default_config()
    c.env.name = "reasoning_gym:chain_sun"
    with pytest.raises(ConfigError, match=r"^config.env.name='reasoning_gym:chain_sun' is "
                                          r"invalid: reasoning-gym has no task 'chain_sun' "
                                          r"\(did you mean reasoning_gym:chain_sum\?\)"):
        arl.validate(c)


def test_trains_through_the_command_line_from_one_config_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=configs/grpo_reasoning_gym.py",
         "--config.env.name=reasoning_gym:chain_sum",
         f"--workdir={tmp_path / 'run'}", "--config.train_steps=2",
         "--config.warm_start.sft_steps=2", "--config.warm_start.sft_batch=4",
         "--config.model.num_layers=1", "--config.rollout.num_tasks=2",
         "--config.rollout.group_size=2", "--config.sample_every=0",
         "--config.env.kwargs.size=32"],
        cwd=_ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    from arl.runs import writers

    records = writers.read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records][-1] == 2
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in records)


_MIXTURE = {"datasets": [{"name": "chain_sum", "weight": 1, "config": _SUMS},
                         {"name": "gcd", "weight": 1, "config": {}}]}


def test_a_composite_reports_each_rows_task_and_metrics_per_task():
    """reasoning_gym:composite: a row's `info["env_id"]` is its task's index (its
    source_dataset), and the rollout metrics hold reward_mean/<i>_<task> and
    success_rate/<i>_<task> (the names a Mixture's members get) equal to the per-task
    means of the batch."""
    from arl.envs.host import _seed_int
    from arl.trainers import credit_assignment

    env = arl.make_env({"name": "reasoning_gym:composite",
                        "kwargs": {"size": 16, "seed": 3, "task_kwargs": _MIXTURE}})
    names = arl.envs.env_names(env)
    assert names == ("0_chain_sum", "1_gcd")
    keys = jax.random.split(jax.random.key(1), 16)
    play = jax.jit(lambda key, keys: rollout_lib.rollout(
        env, key, num_tasks=16, group_size=1, action_source="oracle", reset_keys=keys))
    traj = jax.device_get(play(jax.random.key(0), keys))
    state, _ = jax.vmap(env.reset)(keys, arl.envs.broadcast_params(env.default_params(), 16))
    sources = [env.make_task(_seed_int(state.seed[b]), None)["metadata"]["source_dataset"]
               for b in range(16)]
    env_ids = np.asarray(traj.env_ids)
    np.testing.assert_array_equal(env_ids, [("chain_sum", "gcd").index(s) for s in sources])
    assert set(env_ids.tolist()) == {0, 1}, "the keys should draw both tasks"
    assert bool(traj.success.all())  # each row scored by its own task
    # Metrics per task, against NumPy on a made-up pattern of successes and returns.
    success = np.arange(16) % 3 == 0
    returns = np.linspace(0.0, 1.0, 16, dtype=np.float32)
    made = traj.replace(success=success, episode_return=returns)
    metrics = jax.device_get(credit_assignment.rollout_metrics(made, names))
    for i, name in enumerate(names):
        rows = env_ids == i
        np.testing.assert_allclose(metrics[f"reward_mean/{name}"], returns[rows].mean(),
                                   rtol=1e-6)
        np.testing.assert_allclose(metrics[f"success_rate/{name}"], success[rows].mean(),
                                   rtol=1e-6)


def test_a_composite_entry_that_is_no_task_is_one_line():
    c = arl.default_config()
    c.env.name = "reasoning_gym:composite"
    c.env.kwargs.task_kwargs = {"datasets": [{"name": "chain_sun", "weight": 1}]}
    with pytest.raises(ConfigError, match=r"refused them: task_kwargs.datasets\[0\].name="
                                          r"'chain_sun': reasoning-gym has no such task "
                                          r"\(did you mean chain_sum\?\)"):
        arl.validate(c)


@pytest.mark.slow
def test_a_composite_logs_metrics_per_task_to_metrics_jsonl(tmp_path):
    import textwrap

    config = tmp_path / "composite_config.py"
    config.write_text(textwrap.dedent(f"""
        from configs import grpo_reasoning_gym

        def get_config():
            c = grpo_reasoning_gym.get_config()
            c.env.name = "reasoning_gym:composite"
            c.env.kwargs.task_kwargs = {_MIXTURE!r}
            return c
        """))
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--config={config}",
         f"--workdir={tmp_path / 'run'}", "--config.train_steps=2",
         "--config.warm_start.sft_steps=2", "--config.warm_start.sft_batch=4",
         "--config.model.num_layers=1", "--config.rollout.num_tasks=4",
         "--config.rollout.group_size=2", "--config.sample_every=0",
         "--config.env.kwargs.size=32", "--config.log_every=1"],
        cwd=_ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    from arl.runs import writers

    records = writers.read_metrics(str(tmp_path / "run"))
    assert records and records[-1]["step"] == 2
    for record in records:
        for name in ("0_chain_sum", "1_gcd"):
            assert 0.0 <= record[f"reward_mean/{name}"] <= 1.0, record
            assert 0.0 <= record[f"success_rate/{name}"] <= 1.0, record

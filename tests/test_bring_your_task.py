"""examples/bring_your_task/ as written: its `my_rewards.py` and `my_task.py` copied to a
directory beside the Parquet file its `make_tasks.py` writes; the functions score the
env's oracle and demonstrator episodes as the in-graph verifier does (cheap); the command
of docs/bring_your_task.md trains and learns beyond its starting point, and the Python
API logs every reward (slow)."""

import json
import os
import re
import runpy
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import arl
from arl.rewards.functions import RewardFunctions, episodes
from arl.rollout.rollouts import scripted_rollout

pytest.importorskip("pyarrow")
pytest.importorskip("sympy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "bring_your_task")


def _user_directory(path):
    """The example's files in `path`, and the Parquet file its make_tasks.py writes."""
    for name in ("my_rewards.py", "my_task.py", "make_tasks.py"):
        shutil.copy(os.path.join(EXAMPLE, name), path / name)
    runpy.run_path(str(path / "make_tasks.py"), run_name="__main__")
    assert (path / "tasks.parquet").is_file()
    return path


def _command():
    """docs/bring_your_task.md's training command, without its PYTHONPATH prefix (the
    test sets the same path: the example's directory, then the checkout)."""
    doc = open(os.path.join(ROOT, "docs", "bring_your_task.md"), encoding="utf-8").read()
    section = doc[doc.index("## The whole example"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL).group(1).strip()
    assert block.splitlines()[0] == "cd examples/bring_your_task && python make_tasks.py"
    train = block.splitlines()[1]
    assert train.startswith("PYTHONPATH=.:../.. python -m experiments.train "
                            "--config=my_task.py")
    return train.split()[1:]


def _run_command(user_dir, workdir_name, *overrides, timeout):
    """The documented command in `user_dir`, its workdir `user_dir/workdir_name`, with
    `overrides` appended; returns metrics.jsonl's records after asserting exit 0."""
    command = [a if not a.startswith("--workdir=") else f"--workdir={user_dir / workdir_name}"
               for a in _command()[1:]] + list(overrides)
    result = subprocess.run(
        [sys.executable] + command, cwd=user_dir, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu",
                              "PYTHONPATH": f"{user_dir}{os.pathsep}{ROOT}"})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in open(user_dir / workdir_name / "metrics.jsonl")]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    path = _user_directory(tmp_path)
    monkeypatch.chdir(path)
    monkeypatch.syspath_prepend(str(path))
    for name in ("my_rewards", "my_task"):
        sys.modules.pop(name, None)
    return path


def test_readme_rewards_agree_with_the_verifier(user_dir):
    import my_task  # pylint: disable=import-error,g-import-not-at-top

    config = my_task.get_config()
    arl.validate(config)
    env = arl.make_env(config.env)
    scorer = RewardFunctions(config.reward.functions, config.reward.weights)
    for source in ("oracle", "demonstrator"):
        traj = scripted_rollout(env, jax.random.key(0), num_tasks=32, group_size=1,
                                action_source=source)
        batch = episodes(env, traj.tokens, traj.agent_mask, traj.length, traj.task_rows)
        assert batch.prompts[0][0] == {"role": "system", "content": "Answer with a number."}
        assert set(batch.columns["level"]) <= {"easy", "hard"}
        scores, errors = scorer.score(batch)
        assert errors.tolist() == [0, 0]
        np.testing.assert_array_equal(scores[:, 0], 1.0)  # scripted answers are numbers
        np.testing.assert_array_equal(scores[:, 1], np.asarray(traj.success, np.float32))
        if source == "demonstrator":
            assert 0 < float(np.mean(traj.success)) < 1


@pytest.mark.slow
def test_readme_command_learns_beyond_its_start(user_dir):
    records = _run_command(user_dir, "run", timeout=3000)
    first, last = records[0], records[-1]
    for name in ("formatted", "correct"):
        for stat in ("mean", "std", "errors"):
            assert f"reward/{name}/{stat}" in last
    assert last["reward/formatted/mean"] > first["reward/formatted/mean"] + 0.3
    assert last["reward_mean"] > first["reward_mean"] + 0.2


@pytest.mark.slow
def test_python_api_logs_every_reward(user_dir):
    import my_task  # pylint: disable=import-error,g-import-not-at-top
    from arl.runs import experiment  # pylint: disable=g-import-not-at-top

    config = my_task.get_config()
    config.train_steps, config.log_every = 2, 1
    records = experiment.run(config, str(user_dir / "api"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        total = 0.5 * record["reward/formatted/mean"]
        assert 0.0 <= record["reward/formatted/mean"] <= 1.0
        assert 0.0 <= record["reward/correct/mean"] <= 1.0
        # env_weight 0: the logged return is the functions' weighted sum (all rows scored).
        total += record["reward/correct/mean"]
        assert record["reward_mean"] == pytest.approx(total, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_a_stand_in_reward_model_joins_the_python_rewards(user_dir):
    """The example task with a third reward, a stand-in reward model directory
    (`reward_model.hf_checkpoint`), through the Python API and the command line: every
    reward is logged and the return is their weighted sum."""
    import my_task  # pylint: disable=import-error,g-import-not-at-top
    from arl.runs import experiment  # pylint: disable=g-import-not-at-top
    from tests.hf_standins import build_reward_model_standin  # pylint: disable=g-import-not-at-top

    reward_model = build_reward_model_standin(str(user_dir / "reward_model"), "qwen2")
    config = my_task.get_config()
    config.train_steps, config.log_every = 2, 1
    config.reward_model.hf_checkpoint, config.reward_model.weight = reward_model, 0.25
    records = experiment.run(config, str(user_dir / "api"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert np.isfinite(record["reward/reward_model/mean"])
        assert record["reward/reward_model/std"] > 0.0  # a score per episode, not a constant
        total = (0.5 * record["reward/formatted/mean"] + record["reward/correct/mean"]
                 + 0.25 * record["reward/reward_model/mean"])
        assert record["reward_mean"] == pytest.approx(total, rel=1e-4, abs=1e-5)

    logged = _run_command(user_dir, "cli", "--config.train_steps=2", "--config.log_every=1",
                          f"--config.reward_model.hf_checkpoint={reward_model}",
                          timeout=1800)
    assert [r["step"] for r in logged] == [1, 2]
    assert all(f"reward/{name}/mean" in r for r in logged
               for name in ("formatted", "correct", "reward_model"))

"""`experiments.learning_stages`: per-member numbers of a mixture, the RL curve, and the
stage-1 cache (refused when written for another stage 1; a critic-free run's weights
serve PPO)."""

from __future__ import annotations

import csv
import pickle

import jax
import numpy as np
import pytest

from arl import config as config_lib
from arl.trainers import TokenTrainer
from experiments import learning_stages

# One stage-1 + RL run of a three-env mixture feeds every test here (about 90 s of
# compiling and training): `pytest -m slow`.
pytestmark = pytest.mark.slow

MEMBERS = ("0_bandit", "1_guess_number")


def _mixture_config(algorithm: str = "grpo"):
    c = config_lib.default_config()
    c.algorithm = algorithm
    c.env.name = "mixture"
    c.env.members = ({"name": "bandit", "kwargs": {}},
                     {"name": "guess_number", "kwargs": {"max_n": 8}})
    c.rollout.num_tasks, c.rollout.group_size = (4, 2) if algorithm != "ppo" else (8, 1)
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 1, 64
    c.model.num_heads, c.model.num_kv_heads = 2, 2
    c.train_steps = 2
    c.warm_start.sft_steps, c.warm_start.sft_batch, c.warm_start.sft_lr = 2, 8, 1e-2
    return c


def _fingerprint(c, **changes):
    settings = dict(steps=c.warm_start.sft_steps, batch_size=c.warm_start.sft_batch,
                    learning_rate=c.warm_start.sft_lr, source="")
    settings.update(changes)
    return learning_stages.stage1_fingerprint(c, **settings)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("stage1") / "sft.pkl")
    result, _ = learning_stages.run_stages(_mixture_config(), eval_rounds=1,
                                           sft_cache=cache, log=lambda s: None)
    return result, cache


def test_a_mixture_reports_every_members_success(grpo_run):
    result, _ = grpo_run
    for key in ("demonstrator_members", "sft_sampled_members", "sft_greedy_members",
                "rl_sampled_members", "rl_greedy_members"):
        assert tuple(result[key]) == MEMBERS, key
        assert all(0.0 <= v <= 1.0 for v in result[key].values()), key
    # Rows alternate between the members, so each holds half of them and the overall
    # success is the mean of the members'.
    for stage in ("demonstrator", "sft_sampled", "sft_greedy", "rl_sampled", "rl_greedy"):
        members = result[f"{stage}_members"]
        np.testing.assert_allclose(np.mean(list(members.values())), result[stage][0],
                                   atol=1e-6, err_msg=stage)
    # The bandit's demonstrator pulls the worse arm half the time (success ~0.5 of 512);
    # guess_number's demonstrator is scripted to succeed more often than that.
    assert 0.4 < result["demonstrator_members"]["0_bandit"] < 0.6, result
    assert result["demonstrator_members"]["1_guess_number"] > 0.6, result


def test_the_curve_has_one_row_per_rl_step(grpo_run, tmp_path):
    result, _ = grpo_run
    curve = result["rl_curve"]
    assert len(curve) == result["rl_steps"] == 2
    for row, success in zip(curve, result["rl_history"]):
        assert row["success_rate"] == success
        np.testing.assert_allclose(
            np.mean([row[f"success_rate/{m}"] for m in MEMBERS]), success, atol=1e-6)
        assert np.isfinite(row["entropy"]) and np.isfinite(row["reward_mean"])
    path = tmp_path / "curve.csv"
    learning_stages.write_curve_csv(str(path), curve)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row, written in zip(curve, rows):
        for name, value in row.items():
            np.testing.assert_allclose(float(written[name]), value, rtol=1e-5)


def test_the_cache_is_read_back_and_a_critic_free_stage_1_serves_ppo(grpo_run):
    _, cache = grpo_run
    with open(cache, "rb") as f:
        stored = pickle.load(f)
    assert set(stored) == {"stage1", "params"} and "value_head" not in stored["params"]
    # PPO (a value head) from the GRPO run's stage 1: the same stage-1 fingerprint, so
    # the cache is read (no SFT step: the weights are the stored ones) and the head, as
    # initialised, is added (the model's apply needs it).
    c = _mixture_config("ppo")
    trainer = TokenTrainer(c)
    init = trainer.policy_params(trainer.init_state())
    lines = []
    params = learning_stages.stage1_params(
        trainer, init, steps=c.warm_start.sft_steps, batch_size=c.warm_start.sft_batch,
        learning_rate=c.warm_start.sft_lr, source=None, sft_cache=cache, log=lines.append)
    assert lines == []
    assert jax.tree.structure(params) == jax.tree.structure(init)
    jax.tree.map(np.testing.assert_array_equal, params["value_head"], init["value_head"])
    policy = {k: v for k, v in params.items() if k != "value_head"}
    jax.tree.map(np.testing.assert_array_equal, policy, stored["params"])


def test_a_cache_of_another_stage_1_is_refused(grpo_run, tmp_path):
    _, cache = grpo_run
    c = _mixture_config()
    assert _fingerprint(c) == _fingerprint(_mixture_config("ppo"))  # not the algorithm
    c.optim.learning_rate = 5e-4  # nor the RL stage's schedule
    c.train_steps = 7
    assert _fingerprint(c) == _fingerprint(_mixture_config())
    learning_stages.read_stage1_cache(cache, _fingerprint(c))
    other_env = _mixture_config()
    other_env.env.members[1]["kwargs"]["max_n"] = 16
    other_seed, other_model = _mixture_config(), _mixture_config()
    other_seed.seed = 1
    other_model.model.d_model = 64
    changed = {"steps": _fingerprint(c, steps=3), "source": _fingerprint(c, source="oracle"),
               "seed": _fingerprint(other_seed), "model": _fingerprint(other_model),
               "env": _fingerprint(other_env)}
    for name, fingerprint in changed.items():
        with pytest.raises(ValueError, match="sft_cache=.*another stage 1"):
            learning_stages.read_stage1_cache(cache, fingerprint)
    # A bare params pickle (the format before fingerprints) is read, with a warning.
    bare = tmp_path / "bare.pkl"
    with open(cache, "rb") as f:
        params = pickle.load(f)["params"]
    with open(bare, "wb") as f:
        pickle.dump(params, f)
    lines = []
    loaded = learning_stages.read_stage1_cache(str(bare), _fingerprint(c), log=lines.append)
    assert len(lines) == 1 and "no stage-1 fingerprint" in lines[0]
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), params)


def test_the_plot_script_reads_the_curve_and_averages_over_ten_steps(grpo_run, tmp_path,
                                                                    monkeypatch):
    from benchmarks import plot_learning_curves as plot

    values = np.array([1.0, 0.0, 0.5, 0.25] * 5)
    naive = [np.mean(values[max(0, i - 9):i + 1]) for i in range(len(values))]
    np.testing.assert_allclose(plot.moving_mean(values), naive)
    result, _ = grpo_run
    path = tmp_path / "mixture.csv"
    learning_stages.write_curve_csv(str(path), result["rl_curve"])
    curve = plot.read_curve(str(path))
    assert set(curve) >= {"step", "success_rate", *(f"success_rate/{m}" for m in MEMBERS)}
    out = tmp_path / "curves.png"
    monkeypatch.setattr("sys.argv", ["plot", "--out", str(out), str(path)])
    plot.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""The policy loss as a choice of its own (`config.loss.policy_loss`) beside the advantage
estimator (`config.algorithm`): every pair validates and trains, the named algorithms
`gspo` / `cispo` are presets of a pair, one set of clip settings (`loss.clip_low` /
`clip_high`, 0 = the chosen loss's default) serves every loss, and the retired
`loss.gspo_*` / `loss.cispo_*` keys fail naming their replacement (stored configs that
hold them still load)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

from arl import algorithm_table
from arl import config as config_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSSES = ("ppo", "gspo", "cispo")
ESTIMATORS = algorithm_table.algorithm_names("token")


def _config(algorithm, policy_loss="auto"):
    c = config_lib.default_config()
    c.algorithm = algorithm
    c.loss.policy_loss = policy_loss
    if algorithm == "vineppo":
        c.process.mc_samples = 2
    return c


@pytest.mark.parametrize("policy_loss", LOSSES)
@pytest.mark.parametrize("algorithm", ESTIMATORS)
def test_every_estimator_validates_with_every_policy_loss(algorithm, policy_loss):
    c = _config(algorithm, policy_loss)
    config_lib.validate(c)
    chosen = algorithm_table.chosen_policy_loss(c)
    assert chosen is algorithm_table.get_policy_loss(policy_loss)


def test_named_algorithms_are_presets_of_a_pair():
    for preset in ("gspo", "cispo"):
        row, grpo = algorithm_table.get_algorithm(preset), algorithm_table.get_algorithm("grpo")
        assert row.outcome_advantages is grpo.outcome_advantages
        assert algorithm_table.chosen_policy_loss(_config(preset)).name == preset
        assert algorithm_table.chosen_policy_loss(_config("grpo", preset)).name == preset
        # A preset's loss can itself be replaced.
        assert algorithm_table.chosen_policy_loss(_config(preset, "ppo")).name == "ppo"
    assert algorithm_table.chosen_policy_loss(_config("rloo")).name == "ppo"


def test_one_set_of_clip_settings_with_each_losss_defaults():
    c = config_lib.default_config()
    clips = {name: algorithm_table.get_policy_loss(name).clips(c.loss) for name in LOSSES}
    assert [(k, v.clip_low, v.clip_high) for k, v in clips.items()] == [
        ("ppo", 0.2, 0.2), ("gspo", 3e-4, 4e-4), ("cispo", 1.0, 0.28)]
    c.loss.clip_low, c.loss.clip_high = 0.1, 0.3
    for name in LOSSES:
        got = algorithm_table.get_policy_loss(name).clips(c.loss)
        assert (got.clip_low, got.clip_high) == (0.1, 0.3)


@pytest.mark.parametrize("policy_loss,field,value,message", [
    ("gspo", "clip_low", 2.0, "must be <= 1.0"),
    ("cispo", "clip_high", -0.1, "must be >= 0.0"),
    ("ppo", "clip_low", float("nan"), "expected a finite number"),
    ("cispo", "dual_clip", 3.0, "policy loss 'cispo' has no token ratio to dual-clip: set 0"),
    ("gspo", "dual_clip", 3.0, "policy loss 'gspo' has no token ratio to dual-clip: set 0"),
    ("ppo", "dual_clip", 0.5, "must be > 1.0"),
])
def test_bad_clip_settings_name_the_field(policy_loss, field, value, message):
    c = _config("rloo", policy_loss)
    c.loss[field] = value
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.validate(c)
    assert str(error.value) == f"config.loss.{field}={value!r} is invalid: {message}."


def test_unknown_policy_loss_and_vector_ppo_name_the_field():
    with pytest.raises(config_lib.ConfigError, match=r"config.loss.policy_loss='dpo' is "
                       r"invalid: allowed values are \('auto', 'ppo', 'gspo', 'cispo'\)"):
        config_lib.validate(_config("grpo", "dpo"))
    c = _config("ppo_vector", "gspo")
    c.env.name = "gymnax:CartPole-v1"
    with pytest.raises(config_lib.ConfigError,
                       match="config.loss.policy_loss='gspo' is invalid: algorithm "
                             "'ppo_vector' .* trains with 'ppo' only"):
        config_lib.validate(c)


@pytest.mark.parametrize("key,value", [("gspo_clip_low", 1e-3), ("cispo_clip_high", 0.3)])
def test_a_retired_clip_key_names_its_replacement(key, value):
    c = config_lib.default_config()
    with c.loss.unlocked():
        c.loss[key] = value
    loss_name, side = key.split("_clip_")
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.validate(c)
    assert str(error.value) == (
        f"config.loss.{key}={value!r} is no longer a key: set config.loss.clip_{side} with "
        f"loss.policy_loss='{loss_name}' (or algorithm '{loss_name}'); 0 means "
        f"{loss_name}'s default.")


def test_a_stored_config_with_the_retired_keys_still_loads():
    """A checkpoint written before the change holds PPO's clips in clip_low/high and each
    loss's in its own keys: a gspo run reads its own, a grpo run PPO's."""
    def stored(algorithm):
        c = json.loads(config_lib.default_config().to_json_best_effort())
        c["algorithm"] = algorithm
        del c["loss"]["policy_loss"]
        c["loss"].update(clip_low=0.2, clip_high=0.25, gspo_clip_low=5e-4,
                         gspo_clip_high=6e-4, cispo_clip_low=1.0, cispo_clip_high=0.3)
        return c

    gspo = config_lib.with_defaults(stored("gspo"))
    assert (gspo.loss.clip_low, gspo.loss.clip_high, gspo.loss.policy_loss) == (
        5e-4, 6e-4, "auto")
    assert "gspo_clip_low" not in gspo.loss
    grpo = config_lib.with_defaults(stored("grpo"))
    assert (grpo.loss.clip_low, grpo.loss.clip_high) == (0.2, 0.25)
    config_lib.validate(gspo)


def _train(workdir, algorithm, policy_loss):
    env = {k: v for k, v in os.environ.items()}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=configs/grpo_bandit.py",
         f"--workdir={workdir}", f"--config.algorithm={algorithm}",
         f"--config.loss.policy_loss={policy_loss}", "--config.train_steps=1",
         "--config.log_every=1", "--config.sample_every=0", "--config.loss.sft_coef=0",
         "--config.warm_start.sft_steps=0", "--config.updates.minibatches=2",
         "--config.rollout.num_tasks=2", "--config.rollout.group_size=4",
         "--config.model.d_model=16", "--config.model.num_layers=1",
         "--config.model.num_heads=2", "--config.model.num_kv_heads=2",
         "--config.model.mlp_dim=32"],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow  # two CLI runs, each compiling its step: ~1 min on the 2-core host
# The critic's estimator: its advantages are not all zero under a random policy, whose
# bandit rewards are (no arm named, reward 0 in every row).
@pytest.mark.parametrize("algorithm,policy_loss", [("ppo", "cispo"), ("ppo", "gspo")])
def test_an_estimator_trains_with_another_policy_loss_through_the_cli(tmp_path, algorithm,
                                                                      policy_loss):
    """The same rollout (same seed, same parameters at step 1) scored by two policy
    losses: the rewards agree and the policy loss differs (two minibatches: in the
    second the ratio is no longer 1, where GSPO's loss value would equal PPO's)."""
    from arl.runs import writers  # pylint: disable=import-outside-toplevel

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {loss: pool.submit(_train, tmp_path / loss, algorithm, loss)
                for loss in ("ppo", policy_loss)}
        results = {loss: run.result() for loss, run in runs.items()}
    records = {}
    for loss, result in results.items():
        assert result.returncode == 0, result.stderr[-3000:]
        (records[loss],) = writers.read_metrics(tmp_path / loss)
    assert records["ppo"]["update_skipped"] == records[policy_loss]["update_skipped"] == 0
    assert records["ppo"]["reward_mean"] == records[policy_loss]["reward_mean"]
    assert records["ppo"]["loss/policy"] != records[policy_loss]["loss/policy"]

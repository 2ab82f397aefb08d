"""The train step with in-episode credit assignment (config.process): VinePPO's Monte
Carlo values, process-reward advantages, the learned PRM and PRIME's implicit PRM."""

import jax
import numpy as np
import pytest

from arl import algorithms as alg
from arl import config as config_lib
from arl import rollout as rollout_lib
from arl.trainers import TokenTrainer


def tiny_config(algorithm="grpo", **process):
    c = config_lib.default_config()
    c.algorithm = algorithm
    c.env.name = "guess_number"
    c.env.kwargs = {"max_n": 8}  # max_turns 5
    c.rollout.num_tasks = 4
    c.rollout.group_size = 2
    c.model.d_model = 32
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 64
    c.filters.skip_zero_advantage = False
    for field, value in process.items():
        c.process[field] = value
    return c


def _copy(state):
    """Host copies of the parameter trees (train_step donates its input state)."""
    return {field: None if getattr(state, field) is None
            else jax.tree.map(np.array, getattr(state, field))
            for field in ("params", "ref_params", "prm_params", "implicit_params")}


def _changed(before, after):
    return any(not np.array_equal(x, y)
               for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def _step(config):
    trainer = TokenTrainer(config)
    state = trainer.init_state()
    before = _copy(state)  # train_step donates its input
    state, metrics = trainer.train_step(state)
    metrics = jax.device_get(metrics)
    for name, value in metrics.items():
        assert np.all(np.isfinite(value)), name
    assert int(state.step) == 1
    return before, _copy(state), metrics


@pytest.mark.slow  # ~50 s on 2 loaded cores; the default suite covers the Monte Carlo advantages
# below and branching inside the step in the GRPO test after this one
def test_vineppo_step():
    before, after, metrics = _step(tiny_config("vineppo", mc_samples=2, turn_gamma=0.9))
    assert _changed(before["params"], after["params"])
    assert float(metrics["update_skipped"]) == 0.0
    # Branching before turns 1..4 of every row that reached them, 2 samples each.
    assert float(metrics["mc/env_steps"]) > 0
    assert float(metrics["mc/env_steps_per_rollout_step"]) > 0
    assert after["prm_params"] is None and after["implicit_params"] is None


def test_grpo_step_with_process_rewards_learned_and_implicit_prm():
    # All process terms in one compile (the default suite's budget); each alone below.
    before, after, metrics = _step(tiny_config(
        "grpo", reward_weight=1.0, mc_samples=2, branch_turns=(1, 2), train_prm=True,
        prm_weight=0.5, implicit_coef=0.05))
    assert _changed(before["params"], after["params"])
    assert _changed(before["prm_params"], after["prm_params"])
    assert _changed(before["implicit_params"], after["implicit_params"])
    # The reference policy stays; the implicit PRM starts from it.
    assert not _changed(before["ref_params"], after["ref_params"])
    assert not _changed(before["params"], before["implicit_params"])
    for key in ("prm/loss", "prm/accuracy", "prm/labels", "implicit_prm/loss",
                "implicit_prm/accuracy", "mc/env_steps", "mc/value_mean"):
        assert key in metrics, key
    assert float(metrics["prm/labels"]) >= 8  # at least every row's final state


@pytest.mark.slow  # three more train-step compiles (~1 min each on 2 loaded cores)
@pytest.mark.parametrize("process, changes", [
    (dict(reward_weight=1.0), ()),
    (dict(mc_samples=2, train_prm=True, prm_weight=0.5), ("prm_params",)),
    (dict(implicit_coef=0.05), ("implicit_params",)),
])
def test_grpo_step_with_each_process_term(process, changes):
    before, after, _ = _step(tiny_config("grpo", **process))
    assert _changed(before["params"], after["params"])
    for field in changes:
        assert _changed(before[field], after[field]), field
    for field in {"prm_params", "implicit_params"} - set(changes):
        assert after[field] is None, field


# ---------------------------------------------------------------- advantages, no compile
# of the train step: the trainer's credit assignment on a scripted rollout.


@pytest.fixture(scope="module")
def demo_traj():
    env = TokenTrainer(tiny_config()).env
    return rollout_lib.scripted_rollout(env, jax.random.key(0), num_tasks=4, group_size=2,
                                        action_source="demonstrator")


def test_grpo_advantages_are_process_advantages_without_the_outcome(demo_traj):
    trainer = TokenTrainer(tiny_config("grpo", outcome_weight=0.0, reward_weight=1.0,
                                  turn_gamma=0.9))
    traj = demo_traj
    assert float(np.abs(np.asarray(traj.process_rewards)).sum()) > 0

    @jax.jit
    def advantages(traj):
        return trainer.credit(traj, traj.rewards, None,
                              process_rewards=1.0 * traj.process_rewards).advantages

    got = advantages(traj)
    want = alg.process_advantages(traj.process_rewards, traj.turn_end_mask, traj.agent_mask,
                                  traj.group_ids, num_groups=4, gamma=0.9)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(np.abs(np.asarray(got)).sum()) > 0


def test_vine_advantages_scale_with_the_outcome_weight(demo_traj):
    """Advantages are linear in the reward: with outcome_weight w the Monte Carlo values
    (estimated on the env's reward) must be scaled by w too."""
    from arl.rollout.branching import BranchValues
    traj = demo_traj
    rng = np.random.default_rng(0)
    max_turns = traj.turn_rewards.shape[1]
    known = np.asarray(traj.turn_active) & (rng.random((8, max_turns)) < 0.7)
    branch = BranchValues(
        values=np.where(known, rng.normal(size=(8, max_turns)), 0).astype(np.float32),
        known=known, success=np.zeros((8, max_turns), np.float32),
        env_steps=np.int32(0), tokens=np.int32(0))

    def vine(weight):
        trainer = TokenTrainer(tiny_config("vineppo", mc_samples=2, outcome_weight=weight))
        return np.asarray(jax.jit(lambda t, b: trainer.credit(
            t, t.rewards, None, branch=b).advantages)(traj, branch))

    one, two = vine(1.0), vine(2.0)
    assert np.abs(one).sum() > 0
    np.testing.assert_allclose(two, 2 * one, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize("algorithm, process, match", [
    ("vineppo", dict(mc_samples=0), r"config\.process\.mc_samples=0"),
    ("vineppo", dict(mc_samples=2, reward_weight=1.0), r"config\.algorithm='vineppo'"),
    ("vineppo", dict(mc_samples=2, mc_estimate="soft"), r"config\.process\.mc_estimate"),
    ("grpo", dict(prm_weight=0.5), r"config\.process\.prm_weight=0\.5"),
    ("grpo", dict(train_prm=True), r"config\.process\.train_prm=True"),
    ("grpo", dict(mc_samples=2, branch_turns=(5,)),
     r"config\.process\.branch_turns=\(5,\) must be distinct turns in \[0, max_turns=5\)"),
    ("grpo", dict(mc_samples=2, branch_turns=(1, 1)), r"config\.process\.branch_turns"),
    ("grpo", dict(mc_samples=2, branch_turns=(-1,)), r"config\.process\.branch_turns"),
    ("grpo", dict(mc_samples=-1), r"config\.process\.mc_samples"),
    ("grpo", dict(mc_estimate="median"), r"config\.process\.mc_estimate"),
    ("grpo", dict(turn_gamma=1.5), r"config\.process\.turn_gamma"),
    ("grpo", dict(reward_weight=-1.0), r"config\.process\.reward_weight"),
])
def test_bad_process_settings_are_rejected(algorithm, process, match):
    with pytest.raises(config_lib.ConfigError, match=match):
        TokenTrainer(tiny_config(algorithm, **process))

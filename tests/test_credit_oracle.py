"""An independent oracle of credit assignment (`CreditAssignment`, `rollout_metrics`) and
of the token step's reward shaping: advantages, returns, kept rows and metrics of a
hand-sized batch of multi-turn episodes, recomputed in NumPy float64 from the kernels'
NumPy references (tests/algorithms) composed as the docs describe: each algorithm's
outcome advantages with the outcome weight, the process and implicit rewards, GAE at
token and turn level with whitening over the kept rows, VinePPO's Monte Carlo values,
the StarPO-S and DAPO filters, per-environment metrics; and KL-in-reward in a real
train step (the penalty lowers the reward where the policy is likelier than the
reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl import algorithm_table
from arl import config as config_lib
from arl.rollout.branching import BranchValues
from arl.rollout.trajectory import Trajectory
from arl.trainers.credit_assignment import CreditAssignment, rollout_metrics
from tests.algorithms.test_advantages import (gae_reference, turn_level_gae_reference,
                                               whiten_reference)
from tests.algorithms.test_filters import dapo_reference, starpo_reference
from tests.algorithms.test_group import (env_advantages_reference,
                                         group_advantages_reference, reinforce_pp_reference,
                                         rloo_reference, stats_reference)
from tests.algorithms.test_process import (process_advantages_reference,
                                           tokens_to_turns_reference,
                                           turns_to_tokens_reference,
                                           vine_advantages_reference)

NUM_TASKS, GROUP_SIZE = 3, 4
B, S, MAX_TURNS = NUM_TASKS * GROUP_SIZE, 12, 3
TURN_POSITIONS = ((1, 2), (4, 5, 6), (8, 9, 10))  # agent tokens of turns 0, 1, 2
NUM_ENVS = 2


def _episodes(seed=0):
    """(Trajectory, process rewards, implicit rewards) as float64 NumPy / jnp pairs: 3
    groups of 4 rows of 1-3 turns, a turn's reward on its last agent token, group 1 with
    equal scores in every row (degenerate), two environments."""
    rng = np.random.default_rng(seed)
    num_turns = rng.integers(1, MAX_TURNS + 1, B)
    agent, turn_end, rewards = (np.zeros((B, S)) for _ in range(3))
    for b in range(B):
        for k in range(num_turns[b]):
            agent[b, list(TURN_POSITIONS[k])] = 1.0
            end = TURN_POSITIONS[k][-1]
            turn_end[b, end] = 1.0
            rewards[b, end] = rng.choice([0.0, 0.25, 1.0])
    group_ids = np.repeat(np.arange(NUM_TASKS), GROUP_SIZE)
    degenerate = group_ids == 1
    rewards[degenerate] = 0.0
    rewards[degenerate, 2] = 0.5  # one reward of 0.5 on turn 0's end: equal scores
    env_ids = np.array([0, 1] * (B // 2))
    traj = Trajectory(
        tokens=jnp.zeros((B, S), jnp.int32), agent_mask=jnp.asarray(agent, jnp.float32),
        observation_mask=jnp.zeros((B, S), jnp.float32),
        behaviour_logp=jnp.zeros((B, S), jnp.float32),
        rewards=jnp.asarray(rewards, jnp.float32),
        turn_end_mask=jnp.asarray(turn_end, jnp.float32),
        length=jnp.full((B,), S, jnp.int32), group_ids=jnp.asarray(group_ids, jnp.int32),
        env_ids=jnp.asarray(env_ids, jnp.int32), num_turns=jnp.asarray(num_turns, jnp.int32),
        success=jnp.asarray(rewards.sum(1) >= 1.0), terminated=jnp.ones((B,), bool),
        episode_return=jnp.asarray(rewards.sum(1), jnp.float32),
        format_errors=jnp.asarray(rng.integers(0, 2, B), jnp.int32))
    process = rng.normal(size=(B, S)) * turn_end
    implicit = rng.normal(size=(B, S)) * 0.1 * agent
    return traj, process.astype(np.float32), implicit.astype(np.float32)


def _config(algorithm, **settings):
    c = config_lib.default_config()
    c.algorithm = algorithm
    c.rollout.num_tasks, c.rollout.group_size = NUM_TASKS, GROUP_SIZE
    c.process.outcome_weight = 0.7
    c.process.turn_gamma = 0.9
    c.process.implicit_weight = 0.6
    c.advantage.gamma, c.advantage.lam, c.advantage.turn_gamma = 0.95, 0.8, 0.9
    for path, value in settings.items():
        section, field = path.split("__")
        c[section][field] = value
    return c


def _np(traj):
    return {k: np.asarray(v, np.float64) for k, v in vars(traj).items() if v is not None}


def filters_reference(scores, group_ids, c):
    keep = np.ones(B, bool)
    if c.filters.starpo_keep_fraction < 1.0:
        keep &= starpo_reference(scores, group_ids, NUM_TASKS, c.filters.starpo_keep_fraction,
                                 np.ones(B, bool))
    if c.filters.dapo_zero_variance:
        keep &= dapo_reference(scores, group_ids, NUM_TASKS, np.ones(B, bool))
    return keep


def outcome_reference(name, scores, group_ids, env_ids, valid, c):
    eps = c.advantage.eps
    if name in ("grpo", "drgrpo"):
        return group_advantages_reference(scores, group_ids, NUM_TASKS, valid,
                                          name == "grpo", eps)
    if name == "rloo":
        return rloo_reference(scores, group_ids, NUM_TASKS, valid)
    if name == "reinforce_pp":
        return reinforce_pp_reference(scores, group_ids, NUM_TASKS, valid)
    assert name == "erpo"
    return env_advantages_reference(scores, group_ids, env_ids, NUM_TASKS, NUM_ENVS, valid,
                                    eps, c.advantage.erpo_centre_on_env_mean)


def credit_reference(c, t, rewards, old_values, process, implicit, branch, branch_turns):
    """(advantages, returns or None, valid, metrics) of CreditAssignment, in float64."""
    mask, turn_end, group_ids = t["agent_mask"], t["turn_end_mask"], t["group_ids"]
    p, a = c.process, c.advantage
    scores = rewards.sum(1)
    mean, std, count, degenerate = stats_reference(scores, group_ids, NUM_TASKS,
                                                   np.ones(B, bool))
    keep = filters_reference(scores, group_ids, c)
    metrics = {"degenerate_group_fraction": degenerate[count > 0].mean(),
               "within_group_reward_std": std.mean(), "kept_fraction": keep.mean()}
    dense = np.zeros((B, S)) if process is None else process * turn_end
    credit = algorithm_table.get_algorithm(c.algorithm).credit
    returns = None
    if credit == "outcome":
        seq = outcome_reference(c.algorithm, scores, group_ids, t["env_ids"], keep, c)
        adv = p.outcome_weight * seq[:, None] * mask
        if p.reward_weight > 0 or p.prm_weight > 0:
            adv += process_advantages_reference(dense, turn_end, mask, group_ids,
                                                p.turn_gamma) * keep[:, None]
        if implicit is not None:
            adv += p.implicit_weight * process_advantages_reference(
                implicit, mask, mask, group_ids, 1.0) * keep[:, None]
    elif credit == "gae":
        total = p.outcome_weight * rewards + dense
        if implicit is not None:
            total = total + p.implicit_weight * implicit
        if a.turn_level:
            adv, returns = turn_level_gae_reference(total, old_values, mask, turn_end,
                                                    a.gamma, a.lam, a.turn_gamma, a.lam)
        else:
            adv, returns = gae_reference(total, old_values, mask, a.gamma, a.lam)
        if a.whiten:
            adv = whiten_reference(adv, mask * keep[:, None])
        adv = adv * mask
    else:
        turn_rewards = p.outcome_weight * tokens_to_turns_reference(rewards, turn_end, mask,
                                                                    MAX_TURNS)
        values = p.outcome_weight * np.asarray(branch.values, np.float64)
        known = np.asarray(branch.known).copy()
        if 0 not in branch_turns:
            first = (turn_rewards * p.turn_gamma ** np.arange(MAX_TURNS)).sum(1)
            values[:, 0] = first - rloo_reference(first, group_ids, NUM_TASKS, keep)
            known[:, 0] = True
        turn_adv = vine_advantages_reference(turn_rewards, values, known, t["num_turns"],
                                             p.turn_gamma)
        adv = turns_to_tokens_reference(turn_adv, turn_end, mask)
        if a.whiten:
            adv = whiten_reference(adv, mask * keep[:, None])
        adv = adv * mask
    return adv, returns, keep.astype(np.float64), metrics


def _check(c, *, process=False, implicit=False, branch_turns=(), seed=0):
    """CreditAssignment on the episodes of `seed` against the oracle; `process`: False,
    True (the episodes' process rewards) or the dense rewards to pass."""
    traj, process_rewards, implicit_rewards = _episodes(seed)
    t = _np(traj)
    rewards = t["rewards"]
    rng = np.random.default_rng(seed + 100)
    critic = algorithm_table.get_algorithm(c.algorithm).critic
    old_values = rng.normal(size=(B, S)) * t["agent_mask"] if critic else None
    branch = None
    if branch_turns:
        known = np.zeros((B, MAX_TURNS), bool)
        known[:, list(branch_turns)] = True
        known &= np.arange(MAX_TURNS)[None] < t["num_turns"][:, None]
        branch = BranchValues(values=jnp.asarray(rng.uniform(0, 1, (B, MAX_TURNS)) * known,
                                                 jnp.float32), known=jnp.asarray(known),
                              success=jnp.zeros((B, MAX_TURNS), jnp.float32),
                              env_steps=jnp.zeros((), jnp.int32),
                              tokens=jnp.zeros((), jnp.int32))
    process_in = (process if isinstance(process, np.ndarray) else
                  process_rewards if process else None)
    implicit_in = implicit_rewards if implicit else None
    credit = CreditAssignment(algorithm_table.get_algorithm(c.algorithm), c, num_envs=NUM_ENVS,
                              max_turns=MAX_TURNS, branch_turns=branch_turns)
    got = credit(traj, jnp.asarray(rewards, jnp.float32),
                 None if old_values is None else jnp.asarray(old_values, jnp.float32),
                 process_rewards=None if process_in is None else jnp.asarray(process_in),
                 implicit_rewards=None if implicit_in is None else jnp.asarray(implicit_in),
                 branch=branch)
    adv, returns, valid, metrics = credit_reference(
        c, t, rewards, old_values, process_in, implicit_in, branch, branch_turns)
    np.testing.assert_allclose(got.advantages, adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.valid, valid)
    if returns is None:
        assert got.returns is None
    else:
        np.testing.assert_allclose(got.returns, returns, rtol=1e-5, atol=1e-6)
    assert set(got.metrics) == set(metrics)
    for key, want in metrics.items():
        np.testing.assert_allclose(got.metrics[key], want, rtol=1e-6, atol=1e-7, err_msg=key)
    return adv, valid


@pytest.mark.parametrize("algorithm", ["grpo", "drgrpo", "rloo", "reinforce_pp", "erpo"])
def test_outcome_credit_with_filters_and_process_rewards(algorithm):
    """Each outcome row with the StarPO-S filter (2 of 3 groups), env process rewards
    and PRIME's implicit rewards, all with their weights."""
    c = _config(algorithm, filters__starpo_keep_fraction=0.67, process__reward_weight=0.5)
    adv, valid = _check(c, process=True, implicit=True)
    assert 0 < valid.sum() < B and np.all(adv[valid == 0] == 0) and np.any(adv != 0)


def test_dapo_filter_drops_the_degenerate_group():
    c = _config("grpo", filters__dapo_zero_variance=True)
    _, valid = _check(c)
    np.testing.assert_array_equal(valid, np.repeat([1.0, 0.0, 1.0], GROUP_SIZE))


def test_erpo_centred_on_the_environment_mean():
    _check(_config("erpo", advantage__erpo_centre_on_env_mean=True))


@pytest.mark.parametrize("turn_level", [False, True])
def test_gae_credit_at_token_and_turn_level(turn_level):
    """PPO's GAE on the weighted outcome + process + implicit rewards, whitened over the
    rows StarPO-S keeps."""
    c = _config("ppo", advantage__turn_level=turn_level, advantage__whiten=True,
                filters__starpo_keep_fraction=0.67, process__reward_weight=0.5)
    _check(c, process=True, implicit=True, seed=1)


@pytest.mark.parametrize("branch_turns", [(1, 2), (0, 1)])
def test_monte_carlo_credit(branch_turns):
    """VinePPO: turn advantages from Monte Carlo values at the branch turns, turn 0's
    value the leave-one-out mean return of the group unless turn 0 was branched."""
    c = _config("vineppo", advantage__whiten=True, process__mc_samples=2)
    _check(c, branch_turns=branch_turns, seed=2)


def test_process_reward_weight_scales_the_dense_rewards():
    """The env's process rewards enter the credit with process.reward_weight
    (ProcessModels.process_rewards), and only on turn ends."""
    from arl.trainers.process_reward_models import ProcessModels

    c = _config("grpo", process__reward_weight=0.5)
    traj, process, _ = _episodes(3)
    traj = traj.replace(process_rewards=jnp.asarray(process + 7.0 * (1 - np.asarray(
        traj.turn_end_mask))))  # garbage off the turn ends
    models = ProcessModels.from_config(c, None, group_size=GROUP_SIZE, prompt_len=0)
    dense = models.process_rewards(None, traj)
    np.testing.assert_allclose(dense, 0.5 * np.asarray(traj.process_rewards), rtol=1e-6)
    # ... and the credit reads them on turn ends only: the oracle with that input.
    adv, _ = _check(c, process=np.asarray(dense), seed=3)
    assert np.any(adv != 0)


def test_rollout_metrics_per_environment():
    traj, _, _ = _episodes(4)
    t = _np(traj)
    got = rollout_metrics(traj, ("left", "right"))
    ret, success = t["episode_return"], t["success"]
    want = {"reward_mean": ret.mean(), "reward_std": ret.std(), "success_rate": success.mean(),
            "turns_mean": t["num_turns"].mean(),
            "response_tokens_mean": t["agent_mask"].sum(1).mean(),
            "context_tokens_mean": float(S),
            "format_error_rate": t["format_errors"].sum() / t["num_turns"].sum()}
    for e, name in enumerate(("left", "right")):
        rows = t["env_ids"] == e
        want[f"reward_mean/{name}"] = ret[rows].mean()
        want[f"success_rate/{name}"] = success[rows].mean()
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=key)
    assert "reward_mean/left" not in rollout_metrics(traj, ("only",))


class _RecordingCredit:
    """Wraps a trainer's CreditAssignment and logs what the step passes it (as metrics)."""

    def __init__(self, credit):
        self.credit = credit

    def __call__(self, traj, rewards, old_values, **kwargs):
        out = self.credit(traj, rewards, old_values, **kwargs)
        seen = {"seen/rewards": rewards, "seen/env_rewards": traj.rewards,
                "seen/behaviour_logp": traj.behaviour_logp, "seen/mask": traj.agent_mask,
                "seen/tokens": traj.tokens}
        return out.replace(metrics={**out.metrics, **seen})


def test_kl_in_reward_lowers_the_reward_where_the_policy_is_likelier():
    """In a train step with loss.kl_in_reward, the credit's rewards are the env's minus
    kl_coef * (log pi_behaviour - log pi_ref) on agent tokens (a policy likelier than the
    reference pays), with the reference scored independently here."""
    from arl.trainers import TokenTrainer

    c = config_lib.default_config()
    c.env.name, c.env.kwargs = "guess_number", {"max_n": 8}
    c.rollout.num_tasks, c.rollout.group_size = 2, 2
    c.model.d_model, c.model.num_layers, c.model.num_heads = 16, 1, 2
    c.model.num_kv_heads, c.model.mlp_dim = 2, 32
    c.loss.kl_coef, c.loss.kl_in_reward = 0.3, True
    trainer = TokenTrainer(c)
    trainer.credit = _RecordingCredit(trainer.credit)
    state = trainer.init_state()
    # The policy moves away from the reference (which the state keeps separately).
    noise = jax.random.normal(jax.random.key(1), state.params["lm_head"].shape)
    params = {**state.params, "lm_head": state.params["lm_head"] + 0.5 * noise}
    reference = jax.tree.map(np.asarray, state.ref_params)
    _, metrics = jax.jit(trainer.step)(state.replace(params=params))
    seen = {k[5:]: np.asarray(v, np.float64) for k, v in metrics.items()
            if k.startswith("seen/")}
    ref_logp = trainer.policy.score(reference, jnp.asarray(seen["tokens"], jnp.int32),
                                    **trainer.shared_prompt).logp
    kl = (seen["behaviour_logp"] - np.asarray(ref_logp, np.float64)) * seen["mask"]
    assert np.abs(kl).max() > 0.05
    np.testing.assert_allclose(seen["rewards"], seen["env_rewards"] - 0.3 * kl, atol=2e-5)

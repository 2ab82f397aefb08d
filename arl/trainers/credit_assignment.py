"""Credit assignment: from a trajectory's rewards to token advantages, the filters that
keep or drop groups, and the rollout's metrics.

The credit family of the algorithm's row (`arl.algorithm_table`) decides how the
advantages are formed:
  outcome      A = outcome_weight * A_seq (the row's function of the group scores),
               broadcast over agent tokens, plus leave-one-out advantages of the dense
               process rewards and of PRIME's implicit rewards;
  gae          GAE (token- or turn-level) on outcome_weight * r + dense + implicit, with
               the critic's values recorded during the rollout; optional whitening;
  monte_carlo  VinePPO: A_k = r_k + gamma V(s_k+1) - V(s_k) from forked continuations.
StarPO-S and DAPO filters remove groups (the rows' `valid` weight is 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from arl import algorithm_table
from arl import algorithms as alg
from arl.errors import ConfigError
from arl.rollout.trajectory import Trajectory


@struct.dataclass
class Signals:
    """What the update needs from the signals stage."""

    advantages: jax.Array  # float32 [B, S], zero off the agent mask
    returns: jax.Array | None  # float32 [B, S], critic targets (credit "gae" only)
    valid: jax.Array  # float32 [B]: 1 for rows kept by the filters, else 0
    metrics: dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class CreditAssignment:
    """Advantages of a batch of trajectories for one algorithm and config."""

    algorithm: algorithm_table.Algorithm
    config: ml_collections.ConfigDict
    num_envs: int  # environments (mixture members) a batch can hold
    max_turns: int
    branch_turns: tuple[int, ...]  # Monte Carlo branch points (credit "monte_carlo")

    def __call__(self, traj: Trajectory, rewards: jax.Array, old_values: jax.Array | None,
                 *, process_rewards: jax.Array | None = None,
                 implicit_rewards: jax.Array | None = None, branch=None) -> Signals:
        """`rewards` [B, S] are the turn rewards (KL-in-reward applied); `old_values` the
        critic's values on agent tokens; `process_rewards` dense turn rewards;
        `implicit_rewards` PRIME's token rewards; `branch` the Monte Carlo values."""
        c = self.config
        mask = traj.agent_mask
        num_groups = c.rollout.num_tasks
        scores = rewards.sum(axis=1)
        group_ids = traj.group_ids
        metrics = {}
        stats = alg.group_statistics(scores, group_ids, num_groups=num_groups)
        metrics["degenerate_group_fraction"] = stats.degenerate_fraction()
        metrics["within_group_reward_std"] = jnp.mean(stats.std)

        seq_valid = jnp.ones(scores.shape, jnp.float32)
        if c.filters.starpo_keep_fraction < 1.0:
            keep = alg.starpo_keep_mask(
                scores, group_ids, num_groups=num_groups,
                keep_fraction=c.filters.starpo_keep_fraction)
            seq_valid = seq_valid * keep.astype(jnp.float32)
        if c.filters.dapo_zero_variance:
            keep = alg.dapo_zero_variance_mask(scores, group_ids, num_groups=num_groups)
            seq_valid = seq_valid * keep.astype(jnp.float32)
        metrics["kept_fraction"] = jnp.mean(seq_valid)
        valid = seq_valid > 0

        returns = None
        dense = jnp.zeros_like(rewards)
        if process_rewards is not None:
            dense = dense + process_rewards * traj.turn_end_mask
        credit = self.algorithm.credit
        if credit == "monte_carlo":
            advantages = self._monte_carlo(traj, rewards, branch, valid) * mask
        elif credit == "gae":
            advantages, returns = self._gae(traj, rewards, old_values, dense,
                                            implicit_rewards, seq_valid)
            advantages = advantages * mask
        else:
            advantages = self._outcome(traj, scores, dense, implicit_rewards, valid)
        return Signals(advantages=advantages, returns=returns, valid=seq_valid,
                       metrics=metrics)

    def _outcome(self, traj, scores, dense, implicit_rewards, valid):
        c = self.config
        p = c.process
        mask = traj.agent_mask
        num_groups = c.rollout.num_tasks
        batch = algorithm_table.OutcomeBatch(scores=scores, group_ids=traj.group_ids,
                                 env_ids=traj.env_ids, valid=valid, num_groups=num_groups,
                                 num_envs=self.num_envs)
        seq_adv = self.algorithm.outcome_advantages(batch, c.advantage)
        advantages = p.outcome_weight * seq_adv[:, None] * mask
        if p.reward_weight > 0 or p.prm_weight > 0:
            advantages = advantages + alg.process_advantages(
                dense, traj.turn_end_mask, mask, traj.group_ids, num_groups=num_groups,
                gamma=p.turn_gamma) * valid[:, None]
        if implicit_rewards is not None:
            advantages = advantages + p.implicit_weight * alg.process_advantages(
                implicit_rewards, mask, mask, traj.group_ids, num_groups=num_groups,
                gamma=1.0) * valid[:, None]
        return advantages

    def _gae(self, traj, rewards, old_values, dense, implicit_rewards, seq_valid):
        c = self.config
        p = c.process
        mask = traj.agent_mask
        rewards = p.outcome_weight * rewards + dense
        if implicit_rewards is not None:
            rewards = rewards + p.implicit_weight * implicit_rewards
        if c.advantage.turn_level:
            advantages, returns = alg.turn_level_gae(
                rewards, old_values, mask, traj.turn_end_mask,
                gamma=c.advantage.gamma, lam=c.advantage.lam,
                turn_gamma=c.advantage.turn_gamma)
        else:
            advantages, returns = alg.gae(
                rewards, old_values, mask, gamma=c.advantage.gamma, lam=c.advantage.lam)
        if c.advantage.whiten:
            advantages = alg.whiten(advantages, mask * seq_valid[:, None])
        return advantages, returns

    def _monte_carlo(self, traj, rewards, branch, valid):
        """VinePPO turn advantages r_k + gamma V(s_k+1) - V(s_k) from Monte Carlo values;
        V(s_0) is the leave-one-out mean return of the row's group unless turn 0 was
        branched."""
        c = self.config
        p = c.process
        max_turns = self.max_turns
        turn_rewards = p.outcome_weight * alg.tokens_to_turns(
            rewards, traj.turn_end_mask, traj.agent_mask, num_turns=max_turns)
        # The continuations' returns are in units of the env's reward, like `rewards`.
        values, known = p.outcome_weight * branch.values, branch.known
        if 0 not in self.branch_turns:  # group_size >= 2 (see branch_turns)
            discounts = p.turn_gamma ** jnp.arange(max_turns, dtype=jnp.float32)
            returns = jnp.sum(turn_rewards * discounts, axis=1)
            loo = alg.rloo_advantages(returns, traj.group_ids,
                                      num_groups=c.rollout.num_tasks, valid=valid)
            values = values.at[:, 0].set(returns - loo)  # the mean return of the others
            known = known.at[:, 0].set(True)
        turn_adv = alg.vine_advantages(turn_rewards, values, known, traj.num_turns,
                                       gamma=p.turn_gamma)
        advantages = alg.turns_to_tokens(turn_adv, traj.turn_end_mask, traj.agent_mask)
        if c.advantage.whiten:
            advantages = alg.whiten(advantages, traj.agent_mask * valid[:, None])
        return advantages


def rollout_metrics(traj: Trajectory, env_names: tuple[str, ...]) -> dict[str, jax.Array]:
    """Reward, success, length and format-error statistics of a batch of episodes, the
    means of the env's own per-episode statistics (`Trajectory.episode_stats`, e.g.
    `tools/invalid_call_cap_episodes`), and per environment for a mixture
    (`reward_mean/<name>`, `success_rate/<name>`)."""
    return episode_metrics(
        episode_return=traj.episode_return, success=traj.success, num_turns=traj.num_turns,
        format_errors=traj.format_errors, response_tokens=traj.agent_mask.sum(axis=1),
        context_tokens_mean=jnp.mean(traj.length.astype(jnp.float32)),
        env_ids=traj.env_ids, episode_stats=traj.episode_stats, env_names=env_names)


def episode_metrics(*, episode_return, success, num_turns, format_errors, response_tokens,
                    context_tokens_mean, env_ids, episode_stats,
                    env_names: tuple[str, ...]) -> dict[str, jax.Array]:
    """The metrics of `rollout_metrics` from per-episode [B] arrays, whichever history
    mode played them (`arl.trainers.per_turn` reads its samples' context lengths)."""
    ret = episode_return
    success = success.astype(jnp.float32)
    metrics = {
        "reward_mean": jnp.mean(ret),
        "reward_std": jnp.std(ret),
        "success_rate": jnp.mean(success),
        "turns_mean": jnp.mean(num_turns.astype(jnp.float32)),
        "response_tokens_mean": jnp.mean(response_tokens),
        "context_tokens_mean": context_tokens_mean,
        "format_error_rate": jnp.sum(format_errors) / jnp.maximum(jnp.sum(num_turns), 1),
    }
    for name, values in (episode_stats or {}).items():  # the env's own (`episode_stats`)
        metrics[name] = jnp.mean(values.astype(jnp.float32))
    num_envs = len(env_names)
    if num_envs > 1:
        counts = jax.ops.segment_sum(jnp.ones_like(ret), env_ids, num_envs)
        sums = jax.ops.segment_sum(ret, env_ids, num_envs)
        succ = jax.ops.segment_sum(success, env_ids, num_envs)
        for i, name in enumerate(env_names):
            metrics[f"reward_mean/{name}"] = sums[i] / jnp.maximum(counts[i], 1)
            metrics[f"success_rate/{name}"] = succ[i] / jnp.maximum(counts[i], 1)
    return metrics


def branch_turns(process: ml_collections.ConfigDict, *, max_turns: int, group_size: int,
                 env_name: str) -> tuple[int, ...]:
    """Turns to fork before for Monte Carlo values (process.branch_turns, validated
    against the env's max_turns); turn 0 too when groups cannot supply its value; () when
    no Monte Carlo values are used."""
    if process.mc_samples < 1:
        return ()
    turns = tuple(process.branch_turns) or tuple(range(1, max_turns))
    bad = [t for t in turns if not 0 <= t < max_turns]
    if bad or len(set(turns)) != len(turns):
        raise ConfigError(
            f"config.process.branch_turns={tuple(process.branch_turns)} must be distinct "
            f"turns in [0, max_turns={max_turns}) of env {env_name!r}")
    if group_size < 2 and 0 not in turns:
        turns = (0,) + turns
    if not turns:  # max_turns == 1 with groups: the group mean is the only value
        turns = (0,)
    return tuple(sorted(turns))

"""Credit assignment inside an episode: turn ids, process-reward and Monte Carlo turn
advantages.

Token arrays are `[B, T]` with the agent mask `mask`; a *step* ends on a token where
`step_end` is true (the last agent token of a turn for turn-level process rewards, every
agent token for PRIME's token-level implicit rewards). Turn arrays are `[B, K]` with
`K = max_turns`: entry k belongs to the k-th turn of the row (0-based).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arl.algorithms import _validation as v
from arl.algorithms.advantages import turn_level_gae
from arl.algorithms._segments import check_group_inputs, gather, segment_moments


def _token_inputs(fn, mask, step_end):
    mask = v.boolean(fn, "mask", mask, rank=2, layout="[B, T]")
    step_end = v.boolean(fn, "step_end", step_end, rank=2, layout="[B, T]")
    v.same_shape(fn, "step_end", step_end, "mask", mask.shape)
    return mask, step_end & mask


def turn_ids(step_end, mask) -> jax.Array:
    """The turn each agent token belongs to: `[B, T]` int32, -1 off the agent mask.

    Turn k of a row is the run of agent tokens after the k-th `step_end` token (0-based)
    up to and including the (k+1)-th: an exclusive cumulative count of step ends.
    """
    fn = "turn_ids"
    mask, step_end = _token_inputs(fn, mask, step_end)
    ends = step_end.astype(jnp.int32)
    ids = jnp.cumsum(ends, axis=1) - ends
    return jnp.where(mask, ids, -1)


def turns_to_tokens(per_turn, step_end, mask) -> jax.Array:
    """Spreads a per-turn array `[B, K]` over the agent tokens of each turn: `[B, T]`.

    Token t of turn k gets `per_turn[b, k]`; tokens off the mask, and turns >= K, get 0.
    """
    fn = "turns_to_tokens"
    per_turn = v.floating(fn, "per_turn", per_turn, rank=2, layout="[B, K]")
    mask, step_end = _token_inputs(fn, mask, step_end)
    if per_turn.shape[0] != mask.shape[0]:
        raise ValueError(f"{fn}: `per_turn` has batch {per_turn.shape[0]}, `mask` has "
                         f"{mask.shape[0]}.")
    ids = turn_ids(step_end, mask)
    num_turns = per_turn.shape[1]
    gathered = jnp.take_along_axis(per_turn, jnp.clip(ids, 0, num_turns - 1), axis=1)
    return jnp.where((ids >= 0) & (ids < num_turns), gathered, 0.0)


def process_advantages(process_rewards, step_end, mask, group_ids, *, num_groups: int,
                       gamma: float = 1.0, leave_one_out: bool = True) -> jax.Array:
    """Advantages from dense per-step rewards with a leave-one-out group baseline.

    PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv
    2502.01456, eq. 6): with r^i_s the reward of step s of row i and m_i the mean step
    reward of row i,

    .. math::
        \\tilde r^i_s = r^i_s - \\frac{1}{n_g - 1}\\sum_{j \\in g, j \\ne i} m_j, \\qquad
        A^i_t = \\sum_{s \\ge s(t)} \\gamma^{s - s(t)} \\tilde r^i_s

    where s(t) is the step token t belongs to; every agent token of a step gets the
    step's discounted reward-to-go. Groups with one member (or `leave_one_out=False`)
    use no baseline. Rewards off the step ends are ignored.

    Args:
        process_rewards: [B, T] float; each step's reward on its `step_end` token.
        step_end: [B, T] bool; the last token of each step (turn ends for per-turn
            rewards, the agent mask itself for per-token rewards).
        mask: [B, T] agent mask.
        group_ids: [B] int in [0, num_groups).
        num_groups: static number of groups.
        gamma: discount per step, in [0, 1].
        leave_one_out: subtract the group's leave-one-out mean step reward.

    Returns:
        [B, T] float32 advantages, zero off the mask.
    """
    fn = "process_advantages"
    rewards = v.floating(fn, "process_rewards", process_rewards, rank=2, layout="[B, T]")
    mask, step_end = _token_inputs(fn, mask, step_end)
    v.same_shape(fn, "process_rewards", rewards, "mask", mask.shape)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"{fn}: gamma must be in [0, 1], got {gamma}.")
    rewards = jnp.where(step_end, rewards, 0.0)
    if leave_one_out:
        steps = jnp.sum(step_end, axis=1, dtype=jnp.float32)
        row_mean = jnp.sum(rewards, axis=1) / jnp.maximum(steps, 1.0)
        row_mean, group_ids, num_groups, valid = check_group_inputs(
            fn, row_mean, group_ids, num_groups, None)
        valid = valid & (steps > 0)
        mean, _, count, _ = segment_moments(row_mean, group_ids, num_groups, valid)
        n = gather(count, group_ids, num_groups).astype(jnp.float32)
        group_sum = gather(mean, group_ids, num_groups) * n
        others = n - valid.astype(jnp.float32)
        baseline = (group_sum - jnp.where(valid, row_mean, 0.0)) / jnp.maximum(others, 1.0)
        baseline = jnp.where(others >= 1.0, baseline, 0.0)
        rewards = jnp.where(step_end, rewards - baseline[:, None], 0.0)
    advantages, _ = turn_level_gae(rewards, jnp.zeros_like(rewards), mask, step_end,
                                   gamma=1.0, lam=1.0, turn_gamma=gamma, turn_lam=1.0)
    return advantages


MC_ESTIMATES = ("mean_return", "soft", "hard")


def monte_carlo_values(returns, success, estimate: str) -> jax.Array:
    """The value of a state from N continuations played from it (the last axis).

    .. math::
        \text{mean\_return:}\; \hat V = \tfrac1N \textstyle\sum_j G^{(j)}
        \quad \text{soft:}\; \hat V = \tfrac1N \textstyle\sum_j s^{(j)}
        \quad \text{hard:}\; \hat V = \max_j s^{(j)}

    with G^(j) the discounted return and s^(j) in {0, 1} the success of continuation j:
    VinePPO's Monte Carlo value (Kazemnejad et al. 2024, arXiv 2410.01679) and
    Math-Shepherd's soft and hard labels (Wang et al. 2024, arXiv 2312.08935).

    Args:
        returns: [..., N] float returns of the continuations.
        success: [..., N] float (0 or 1) or bool success of the continuations.
        estimate: one of `MC_ESTIMATES`.

    Returns:
        [...] float32 values.
    """
    fn = "monte_carlo_values"
    if estimate not in MC_ESTIMATES:
        raise ValueError(f"{fn}: estimate={estimate!r}; allowed values are {MC_ESTIMATES}.")
    returns = v.floating(fn, "returns", returns)
    success = jnp.asarray(success)
    v.same_shape(fn, "success", success, "returns", returns.shape)
    if returns.ndim < 1 or returns.shape[-1] < 1:
        raise ValueError(f"{fn}: `returns` needs a non-empty last axis (the continuations), "
                         f"got shape {returns.shape}.")
    success = success.astype(jnp.float32)
    if estimate == "mean_return":
        return jnp.mean(returns.astype(jnp.float32), axis=-1)
    if estimate == "soft":
        return jnp.mean(success, axis=-1)
    return jnp.max(success, axis=-1)


def vine_advantages(turn_rewards, turn_values, value_known, num_turns, *,
                    gamma: float = 1.0) -> jax.Array:
    """Turn advantages from Monte Carlo state values, in place of a critic.

    VinePPO (Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential for LLM Reasoning
    Through Refined Credit Assignment", arXiv 2410.01679), with values estimated by
    rolling the policy out from forked states (Math-Shepherd, Wang et al. 2024, arXiv
    2312.08935):

    .. math:: A_k = r_k + \\gamma \\hat V(s_{k+1}) - \\hat V(s_k)

    where s_k is the state before turn k and the state after the last played turn has
    value 0. Where values are known only at some turns (`value_known`), the turns
    between two known states form one segment a <= k < b sharing the advantage

    .. math:: A_k = \\sum_{j=a}^{b-1} \\gamma^{j-a} r_j + \\gamma^{b-a} \\hat V(s_b)
              - \\hat V(s_a).

    A row whose first value is unknown uses baseline 0 for its first segment.

    Args:
        turn_rewards: [B, K] float reward of each turn.
        turn_values: [B, K] float estimate of V(s_k), the value before turn k.
        value_known: [B, K] bool, where `turn_values` holds an estimate.
        num_turns: [B] int turns played; turns k >= num_turns get advantage 0.
        gamma: discount per turn, in [0, 1].

    Returns:
        [B, K] float32 turn advantages.
    """
    fn = "vine_advantages"
    rewards = v.floating(fn, "turn_rewards", turn_rewards, rank=2, layout="[B, K]")
    values = v.floating(fn, "turn_values", turn_values, rank=2, layout="[B, K]")
    v.same_shape(fn, "turn_values", values, "turn_rewards", rewards.shape)
    known = v.boolean(fn, "value_known", value_known, rank=2, layout="[B, K]")
    v.same_shape(fn, "value_known", known, "turn_rewards", rewards.shape)
    num_turns = v.array(fn, "num_turns", num_turns, rank=1, layout="[B]")
    if num_turns.shape[0] != rewards.shape[0]:
        raise ValueError(f"{fn}: `num_turns` must have shape ({rewards.shape[0]},), got "
                         f"{num_turns.shape}.")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"{fn}: gamma must be in [0, 1], got {gamma}.")
    k = jnp.arange(rewards.shape[1])[None, :]
    played = k < num_turns[:, None]
    rewards = jnp.where(played, rewards, 0.0)
    values = jnp.where(known & played, values, 0.0)
    # A state is a segment boundary when its value is known or the episode is over.
    boundary = (known & played) | ~played

    def backward(next_return, x):
        reward, value_next, boundary_next = x
        ret = reward + gamma * jnp.where(boundary_next, value_next, next_return)
        return ret, ret

    shifted = lambda x, fill: jnp.concatenate([x[:, 1:], jnp.full_like(x[:, :1], fill)], 1)
    xs = (rewards.T, shifted(values, 0.0).T, shifted(boundary, True).T)
    _, segment_return = jax.lax.scan(backward, jnp.zeros_like(rewards[:, 0]), xs,
                                     reverse=True)
    segment_return = segment_return.T

    def forward(current, x):
        ret, value, starts = x
        current = jnp.where(starts, ret - value, current)
        return current, current

    starts = boundary.at[:, 0].set(True)
    _, advantages = jax.lax.scan(forward, jnp.zeros_like(rewards[:, 0]),
                                 (segment_return.T, values.T, starts.T))
    return jnp.where(played, advantages.T, 0.0)


def tokens_to_turns(x, step_end, mask, *, num_turns: int) -> jax.Array:
    """Sums a token array `[B, T]` over the agent tokens of each turn: `[B, num_turns]`.

    The inverse of `turns_to_tokens` for rewards placed on turn ends; tokens of turns
    >= num_turns and tokens off the mask are dropped.
    """
    fn = "tokens_to_turns"
    x = v.floating(fn, "x", x, rank=2, layout="[B, T]")
    mask, step_end = _token_inputs(fn, mask, step_end)
    v.same_shape(fn, "x", x, "mask", mask.shape)
    if not isinstance(num_turns, int) or num_turns < 1:
        raise ValueError(f"{fn}: num_turns must be a positive int, got {num_turns!r}.")
    ids = jnp.where(mask, turn_ids(step_end, mask), num_turns)
    return jax.vmap(lambda i, row: jnp.zeros((num_turns,), row.dtype).at[i].add(
        row, mode="drop"))(ids, x)

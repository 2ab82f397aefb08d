"""Generalised advantage estimation over masked, multi-turn token sequences.

Layout: token arrays are `[B, T]` (batch-major); `mask` is true on the tokens the policy
wrote (the agent mask). All kernels share one rule: on a token outside the mask the
recursion's carry passes through unchanged, so the observation tokens of a multi-turn
trajectory are skipped and the discount counts agent tokens only.

Episode boundaries inside a sequence (vector environments with auto-reset; time-major
users transpose to `[B, T]` first) are given per token:

* `dones[b, t]`: an episode ended right after token t (for any reason). The trace is cut:
  token t sees no advantage from later tokens and, unless truncated, a next value of 0.
* `truncated[b, t]`: the episode ended after token t by a time limit. It also ends the
  episode (it implies `dones`), but token t bootstraps from `next_values[b, t]`, the
  value of the final observation (the one an auto-reset wrapper discards).
* `bootstrap_value[b]`: the value after the last token of the sequence (a trajectory
  cut by the buffer length); 0 by default. A boundary on the last token overrides it.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from arl import backend
from arl.algorithms import _validation as v

GAE_METHODS = ("auto", "scan", "associative")
_SCAN_UNROLL = 1


def _resolve_method(method: str) -> str:
    """The kernel `method` names; "auto" is the backend's (`arl.backend.gae_method`)."""
    method = v.choice("gae", "method", method, GAE_METHODS)
    return backend.gae_method() if method == "auto" else method


def _check_inputs(fn, rewards, values, mask, bootstrap_value, dones, truncated,
                  next_values):
    layout = "[B, T]"
    rewards = v.floating(fn, "rewards", rewards, rank=2, layout=layout)
    shape = rewards.shape
    values = v.floating(fn, "values", values, rank=2, layout=layout)
    v.same_shape(fn, "values", values, "rewards", shape)
    mask = v.boolean(fn, "mask", mask, rank=2, layout=layout)
    v.same_shape(fn, "mask", mask, "rewards", shape)
    if bootstrap_value is None:
        bootstrap_value = jnp.zeros(shape[:1], jnp.float32)
    bootstrap_value = v.floating(fn, "bootstrap_value", bootstrap_value, rank=1,
                                 layout="[B]")
    v.shape(fn, "bootstrap_value", bootstrap_value, shape[:1], "[B]")
    if truncated is not None and next_values is None:
        raise ValueError(f"{fn}: `truncated` needs `next_values` [B, T] (the value of the "
                         "final observation of each truncated episode).")
    if next_values is not None and truncated is None:
        raise ValueError(f"{fn}: `next_values` is only used with `truncated` [B, T].")
    if dones is not None:
        dones = v.boolean(fn, "dones", dones, rank=2, layout=layout)
        v.same_shape(fn, "dones", dones, "rewards", shape)
    if truncated is not None:
        truncated = v.boolean(fn, "truncated", truncated, rank=2, layout=layout)
        v.same_shape(fn, "truncated", truncated, "rewards", shape)
        next_values = v.floating(fn, "next_values", next_values, rank=2, layout=layout)
        v.same_shape(fn, "next_values", next_values, "rewards", shape)
    return rewards, values, mask, bootstrap_value, dones, truncated, next_values


def _boundaries(dones, truncated, next_values, shape):
    """(episode ends after t, value to bootstrap from there) or None if no boundaries."""
    if dones is None and truncated is None:
        return None
    ends = jnp.zeros(shape, bool)
    if dones is not None:
        ends = ends | dones
    boundary_value = jnp.zeros(shape, jnp.float32)
    if truncated is not None:
        ends = ends | truncated
        boundary_value = jnp.where(truncated, next_values, 0.0)
    return ends, boundary_value


def _carry_recurrence(rewards, values, mask, bootstrap_value, boundaries, gamma, lam):
    """Rewrites the two-carry recursion of `gae` as ONE linear recurrence.

    Let Y be what an agent token receives from the next agent token t' of its episode,
    Y = gamma * V_t' + gamma * lam * A_t'. Then on an agent token

        A_t = (r_t - V_t) + Y_in,    Y_out = gamma * lam * Y_in + gamma * lam * (r_t - V_t)
                                             + gamma * V_t,

    and a non-agent token passes Y through. So Y follows y[t] = decay[t] * y[t+1] +
    drive[t] (a scalar carry, like unmasked GAE) and the advantages follow from Y_in by
    one vectorised pass. An episode end at t resets Y_in to gamma * boundary_value[t]
    (next value from the boundary, no advantage carried over).

    Returns:
        (decay, drive, finish) where `finish(y_in)` maps the incoming carry of every
        token ([B, T]; y_in[t] = y[t + 1], y[T] = gamma * bootstrap) to advantages.
    """
    gamma_lam = gamma * lam
    td_part = jnp.where(mask, rewards - values, 0.0)
    drive = jnp.where(mask, gamma_lam * td_part + gamma * values, 0.0)
    decay = jnp.where(mask, gamma_lam, 1.0) * jnp.ones_like(drive)
    if boundaries is not None:
        ends, boundary_value = boundaries
        reset = gamma * boundary_value
        drive = jnp.where(ends, drive + jnp.where(mask, gamma_lam, 1.0) * reset, drive)
        decay = jnp.where(ends, 0.0, decay)

    def finish(carry_in):
        if boundaries is not None:
            carry_in = jnp.where(ends, reset, carry_in)
        return jnp.where(mask, td_part + carry_in, 0.0)

    return decay, drive, finish


def _gae_scan(rewards, values, mask, bootstrap_value, boundaries, gamma, lam):
    """One reverse `lax.scan` over time with a scalar carry per row.

    The inputs are read time-major once (plain transposes of rewards, values, the mask and
    the boundaries) and the loop emits the advantages and returns themselves, so no fusion
    ever reads a [T, B] array transposed (on CPU such a fusion cost 2-5x the whole scan).
    Per token: y_in -> (A_t, R_t, y_out) as in `_carry_recurrence`, with an episode end
    resetting y_in to gamma * boundary_value first.
    """
    gamma_lam = gamma * lam
    time_major = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731

    def token(carry, mask_t, reward_t, value_t):
        td = reward_t - value_t
        advantage = jnp.where(mask_t, td + carry, 0.0)
        ret = jnp.where(mask_t, advantage + value_t, 0.0)
        carry = jnp.where(mask_t, gamma_lam * td + gamma * value_t + gamma_lam * carry, carry)
        return carry, (advantage, ret)

    if boundaries is None:
        def step(carry, x):
            return token(carry, *x)

        xs = (time_major(mask), time_major(rewards), time_major(values))
    else:
        ends, boundary_value = boundaries

        def step(carry, x):
            mask_t, reward_t, value_t, end_t, boundary_t = x
            return token(jnp.where(end_t, gamma * boundary_t, carry), mask_t, reward_t,
                         value_t)

        xs = (time_major(mask), time_major(rewards), time_major(values), time_major(ends),
              time_major(boundary_value))
    _, (advantages, returns) = jax.lax.scan(step, gamma * bootstrap_value, xs, reverse=True,
                                            unroll=_SCAN_UNROLL)
    return time_major(advantages), time_major(returns)


def _gae_associative(rewards, values, mask, bootstrap_value, boundaries, gamma, lam):
    """The same linear recurrence solved by an associative scan (Blelloch 1990).

    Composes the affine maps y -> drive[t] + decay[t] * y pairwise: O(log T) depth.
    """
    decay, drive, finish = _carry_recurrence(rewards, values, mask, bootstrap_value,
                                             boundaries, gamma, lam)

    def compose(inner, outer):
        decay_in, drive_in = inner
        decay_out, drive_out = outer
        return decay_out * decay_in, decay_out * drive_in + drive_out

    decay_cum, drive_cum = jax.lax.associative_scan(compose, (decay, drive), reverse=True,
                                                    axis=1)
    carry_out = decay_cum * (gamma * bootstrap_value)[:, None] + drive_cum
    carry_in = jnp.concatenate([carry_out[:, 1:], (gamma * bootstrap_value)[:, None]],
                               axis=1)
    advantages = finish(carry_in)
    return advantages, jnp.where(mask, advantages + values, 0.0)


def gae(rewards, values, mask, *, gamma=1.0, lam=1.0, bootstrap_value=None, dones=None,
        truncated=None, next_values=None, method: str = "auto"):
    """Generalised advantage estimation with an agent mask (Schulman et al. 2016).

    Reverse recursion over time. On an agent token t (`mask[b, t]` true):

    .. math::
        \\delta_t = r_t + \\gamma V_{next} - V_t, \\qquad
        A_t = \\delta_t + \\gamma\\lambda A_{next}, \\qquad
        (V_{next}, A_{next}) \\leftarrow (V_t, A_t)

    On a non-agent token the carry `(V_next, A_next)` passes through unchanged and the
    output is 0. Initially `V_next = bootstrap_value` and `A_next = 0`. Returns are
    `A_t + V_t` on agent tokens. Rewards must sit on agent tokens (a turn's reward on
    its last agent token). Episode boundaries (see module docstring): where
    `dones | truncated` at t, before token t is processed the carry is reset to
    `(truncated ? next_values[t] : 0, 0)`.

    With `mask` all true and no boundaries this is rlax's
    `truncated_generalized_advantage_estimation` with discount `gamma` and the bootstrap
    value appended to `values`.

    Args:
        rewards: [B, T] float.
        values: [B, T] float, V(s_t) for each token.
        mask: [B, T] agent mask (bool or 0/1).
        gamma: discount per agent token, in [0, 1] (scalar; may be traced).
        lam: GAE lambda, in [0, 1] (scalar; may be traced).
        bootstrap_value: [B] value after the last token; default 0.
        dones: [B, T] optional, an episode ended after token t (cuts the trace).
        truncated: [B, T] optional, the episode ended after t by truncation (implies
            done); requires `next_values`.
        next_values: [B, T] value of the final observation of each truncated episode
            (read only where `truncated`).
        method: "scan" (sequential `lax.scan`), "associative" (`lax.associative_scan`,
            O(log T) depth) or "auto" (the backend's, `arl.backend.gae_method`:
            "scan" on CPU, "associative" elsewhere). Both compute the same function.

    Returns:
        (advantages, returns): both [B, T] float32, zero where `mask` is 0.
    """
    fn = "gae"
    rewards, values, mask, bootstrap_value, dones, truncated, next_values = _check_inputs(
        fn, rewards, values, mask, bootstrap_value, dones, truncated, next_values)
    gamma = v.scalar(fn, "gamma", gamma, low=0.0, high=1.0)
    lam = v.scalar(fn, "lam", lam, low=0.0, high=1.0)
    method = _resolve_method(method)
    boundaries = _boundaries(dones, truncated, next_values, rewards.shape)
    kernel = {"scan": _gae_scan, "associative": _gae_associative}[method]
    return kernel(rewards, values, mask, bootstrap_value, boundaries, gamma, lam)


def discounted_returns(rewards, mask, *, gamma=1.0, bootstrap_value=None, dones=None,
                       truncated=None, next_values=None, method: str = "auto"):
    """Discounted reward-to-go over agent tokens (Monte-Carlo returns).

    .. math:: G_t = r_t + \\gamma G_{next}

    on agent tokens, with `G_next = bootstrap_value` after the last token and the same
    pass-through rule as `gae`: non-agent tokens leave the carry unchanged (and output
    0), so the discount counts agent tokens only. Episode boundaries as in `gae`
    (terminated: G_next = 0; truncated: G_next = next_values[t]). This is `gae` with
    zero values and lambda = 1 (Sutton & Barto 2018, eq. 3.8).

    Args:
        rewards: [B, T] float.
        mask: [B, T] agent mask.
        gamma: discount per agent token, in [0, 1].
        bootstrap_value: [B] value after the last token; default 0.
        dones, truncated, next_values: episode boundaries, as in `gae`.
        method: as in `gae`.

    Returns:
        [B, T] float32 returns, zero where `mask` is 0.
    """
    fn = "discounted_returns"
    rewards = v.floating(fn, "rewards", rewards, rank=2, layout="[B, T]")
    advantages, _ = gae(rewards, jnp.zeros_like(rewards), mask, gamma=gamma, lam=1.0,
                        bootstrap_value=bootstrap_value, dones=dones, truncated=truncated,
                        next_values=next_values, method=method)
    return advantages


def turn_level_gae(rewards, values, mask, turn_end, *, gamma=1.0, lam=1.0,
                   turn_gamma=1.0, turn_lam=None, bootstrap_value=None,
                   method: str = "auto"):
    """Bi-level (turn-level, then token-level) GAE for multi-turn agents.

    As in RAGEN's bi-level GAE (Wang et al. 2025, arXiv 2504.20073) and ArCHer's
    hierarchical critic (Zhou et al. 2024, arXiv 2402.19446). Let e_1 < ... < e_K be the
    turn-end tokens of a row (`turn_end`, the last agent token of each turn).

    1. Turn level: GAE over the turn ends only, with `turn_gamma` and `turn_lam`:

       .. math::
           \\delta_k = r_{e_k} + \\gamma_{turn} V_{e_{k+1}} - V_{e_k}, \\quad
           A_k = \\delta_k + \\gamma_{turn}\\lambda_{turn} A_{k+1}, \\quad
           G_k = A_k + V_{e_k}

       with `V_{e_{K+1}} = bootstrap_value`.
    2. Token level: ordinary masked GAE (`gamma`, `lam`) inside each turn, where the
       turn's last token receives the turn return `G_k` as its reward and is terminal
       (next value 0, carry reset). The last token of a turn thus gets advantage `A_k`.

    Rewards off the turn ends (e.g. per-token penalties) enter only the token level.

    Args:
        rewards: [B, T] float; turn rewards on the turn-end tokens.
        values: [B, T] float token values.
        mask: [B, T] agent mask.
        turn_end: [B, T] bool, true on the last agent token of each turn (tokens outside
            `mask` are ignored).
        gamma, lam: token-level discount and lambda.
        turn_gamma: turn-level discount (per turn).
        turn_lam: turn-level lambda; defaults to `lam`.
        bootstrap_value: [B] value after the last turn; default 0.
        method: as in `gae`.

    Returns:
        (advantages, returns): [B, T] float32, zero where `mask` is 0.
    """
    fn = "turn_level_gae"
    rewards = v.floating(fn, "rewards", rewards, rank=2, layout="[B, T]")
    mask = v.boolean(fn, "mask", mask, rank=2, layout="[B, T]")
    v.same_shape(fn, "mask", mask, "rewards", rewards.shape)
    turn_end = v.boolean(fn, "turn_end", turn_end, rank=2, layout="[B, T]")
    v.same_shape(fn, "turn_end", turn_end, "rewards", rewards.shape)
    if turn_lam is None:
        turn_lam = lam
    turn_end = turn_end & mask
    _, turn_returns = gae(rewards, values, turn_end, gamma=turn_gamma, lam=turn_lam,
                          bootstrap_value=bootstrap_value, method=method)
    token_rewards = jnp.where(turn_end, turn_returns, jnp.where(mask, rewards, 0.0))
    return gae(token_rewards, values, mask, gamma=gamma, lam=lam, dones=turn_end,
               method=method)

"""Fault counts computed inside the compiled step: non-finite rewards and out-of-range
token ids per environment, a non-finite loss or gradient. The host loop reads them
(`arl.runs.run_guards.NonFiniteGuard`) and stops the run, naming the env, the step and
the quantity, before a non-finite state reaches a checkpoint; with
``config.on_non_finite = "skip"`` the step itself keeps its parameters instead (optax's
`apply_if_finite` pattern) and the host warns.

Every count is a metric under ``faults/`` (popped by the host guard, never logged):

    faults/nonfinite_rewards/<env>       NaN or inf rewards of that env's rows
    faults/token_ids_out_of_range/<env>  tokens outside [0, vocab) in its rows (token envs)
    faults/nonfinite_loss                1 when the update's loss was NaN or inf
    faults/nonfinite_grads               1 when its gradients' global norm was
    faults/nonfinite_params              1 when the updated parameters hold NaN or inf
                                         (the vector trainer, which computes no
                                         gradient norm unless `vector.diagnostics`)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from arl.trainers.tracing import trace_once

PREFIX = "faults/"
REWARDS = "nonfinite_rewards"
TOKEN_IDS = "token_ids_out_of_range"
LOSS = "nonfinite_loss"
GRADS = "nonfinite_grads"
PARAMS = "nonfinite_params"


def _per_env(bad_per_row: jax.Array, env_ids: jax.Array | None,
             env_names: Sequence[str], quantity: str) -> dict[str, jax.Array]:
    if env_ids is None or len(env_names) == 1:
        return {f"{PREFIX}{quantity}/{env_names[0]}": jnp.sum(bad_per_row, dtype=jnp.float32)}
    return {f"{PREFIX}{quantity}/{name}": jnp.sum(jnp.where(env_ids == i, bad_per_row, 0),
                                                   dtype=jnp.float32)
            for i, name in enumerate(env_names)}


def rollout_faults(rewards: jax.Array, env_names: Sequence[str], *,
                   env_ids: jax.Array | None = None, tokens: jax.Array | None = None,
                   vocab_size: int | None = None) -> dict[str, jax.Array]:
    """Counts of non-finite `rewards` [B, ...] and of `tokens` [B, T] outside
    [0, vocab_size), per env (`env_ids` [B] index `env_names`)."""
    rows = rewards.shape[0]
    faults = _per_env(jnp.sum(~jnp.isfinite(rewards.reshape(rows, -1)), axis=1), env_ids,
                      env_names, REWARDS)
    if tokens is not None:
        out_of_range = (tokens < 0) | (tokens >= vocab_size)
        faults.update(_per_env(jnp.sum(out_of_range, axis=1), env_ids, env_names,
                               TOKEN_IDS))
    return faults


def inputs_finite(faults: dict[str, jax.Array]) -> jax.Array:
    """True when no reward was non-finite and no token id out of range."""
    return jnp.all(jnp.stack([value == 0 for value in faults.values()]))


def update_faults(**quantities: jax.Array) -> dict[str, jax.Array]:
    """``faults/<quantity>``: 1.0 where the scalar is NaN or inf (a global norm is
    non-finite exactly when an element is, or overflows), e.g.
    ``update_faults(nonfinite_loss=loss, nonfinite_grads=grad_norm)``."""
    return {f"{PREFIX}{quantity}": (~jnp.isfinite(value)).astype(jnp.float32)
            for quantity, value in quantities.items()}


def update_failed(faults: dict[str, jax.Array]) -> jax.Array:
    """True when the loss, gradients or parameters of the update were non-finite."""
    keys = [f"{PREFIX}{q}" for q in (LOSS, GRADS, PARAMS) if f"{PREFIX}{q}" in faults]
    return jnp.any(jnp.stack([faults[k] > 0 for k in keys]))


def keep_unless(bad: jax.Array, new: Any, old: Any) -> Any:
    """`old` where `bad` (a scalar bool), else `new`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(bad, o, n), new, old)


def guarded_update(update: Callable, has_signal: jax.Array, params: Any, opt_state: Any,
                   faults: dict[str, jax.Array], on_non_finite: str
                   ) -> tuple[Any, Any, dict[str, jax.Array], dict[str, jax.Array]]:
    """(params, opt_state, update metrics, faults) of `update(params, opt_state)` (which
    returns those three) where `has_signal`, else the inputs with zero metrics; with
    ``on_non_finite == "skip"`` an update whose loss or gradient norm is not finite keeps
    the inputs too. `faults` gains the update's counts (`update_faults`).

    The update is traced once (`trace_once`): the skipping branch needs its metrics'
    shapes, and a second trace (forward, backward, optimizer) was a fifth of the step's
    lowering."""
    do_update, shapes = trace_once(lambda operand: update(*operand), (params, opt_state))

    def skip_update(operand):
        kept_params, kept_opt_state = operand
        return kept_params, kept_opt_state, jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), shapes[2])

    new_params, new_opt_state, metrics = jax.lax.cond(
        has_signal, do_update, skip_update, (params, opt_state))
    faults = {**faults, **update_faults(nonfinite_loss=metrics["loss/total"],
                                        nonfinite_grads=metrics["grad_norm"])}
    if on_non_finite == "skip":
        new_params, new_opt_state = keep_unless(update_failed(faults),
                                                (new_params, new_opt_state),
                                                (params, opt_state))
    return new_params, new_opt_state, metrics, faults

"""The optimizer of `config.optim`, one builder for every trainer: the RL update of both
trainers, the SFT warm start and the process reward models.

    optimizer = make_optimizer(config.optim, total_updates=rl_updates(config))
    optimizer = make_optimizer(config.optim, learning_rate=3e-3)   # a constant rate

Every field means the same everywhere: global-norm clipping at `max_grad_norm` (none
when 0), then AdamW with `b1`, `b2`, `eps` and decoupled `weight_decay`, on the
learning-rate schedule of `schedule` / `warmup_steps` (or a given constant rate).

Low-precision parameters (`model.param_dtype="bfloat16"`): `make_optimizer(...,
param_dtype=...)` wraps the chain in `float32_master_weights`, the mixed-precision
recipe of Micikevicius et al. 2018 ("Mixed Precision Training", arXiv 1710.03740): the
optimizer state holds a float32 copy of the parameters (the master weights) and the
chain's state (Adam's first and second moments) is built over that copy, so it is
float32 too. Each step casts the gradients to float32, updates the master weights, and
the new parameters are the master weights rounded to bfloat16. Without master weights
an RL-sized step (learning rate 1e-6 times an Adam direction of about 1) on a weight of
0.02 is ~1/4000 of it, below half a bfloat16 ulp (2^-9 relative): it rounds away and
the weights never move. The cost is 4 + 8 bytes of optimizer state per parameter next
to the 2-byte bfloat16 parameters (14 bytes against float32 training's 12), paid for
half-size parameters in the forward passes, the rollout and the KL reference.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

LR_SCHEDULES = ("constant", "linear", "cosine")


def rl_updates(config: ml_collections.ConfigDict) -> int:
    """Optimizer steps of a whole RL run: train_steps x epochs x minibatches."""
    return config.train_steps * config.updates.epochs * config.updates.minibatches


def learning_rate_schedule(optim: ml_collections.ConfigDict, total_updates: int
                           ) -> optax.Schedule:
    """`optim.schedule` over `total_updates` optimizer steps, after a linear warmup of
    `optim.warmup_steps` from 0: constant, linear decay to 0, or cosine decay to 0."""
    o = optim
    total = max(1, total_updates)
    if o.schedule == "constant":
        decay = optax.constant_schedule(o.learning_rate)
    elif o.schedule == "linear":
        decay = optax.linear_schedule(o.learning_rate, 0.0, max(1, total - o.warmup_steps))
    else:
        decay = optax.cosine_decay_schedule(o.learning_rate, max(1, total - o.warmup_steps))
    if not o.warmup_steps:
        return decay
    return optax.join_schedules(
        [optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps), decay],
        [o.warmup_steps])


def make_optimizer(optim: ml_collections.ConfigDict, *,
                   learning_rate: float | optax.Schedule | None = None,
                   total_updates: int = 1,
                   param_dtype: Any = "float32") -> optax.GradientTransformation:
    """Clipping then AdamW as `optim` says; the rate is `learning_rate` if given (the warm
    start's and the PRMs' own constant rates), else `optim`'s schedule over
    `total_updates` optimizer steps. Parameters stored in a lower precision than float32
    (`param_dtype`, `config.model.param_dtype`) get float32 master weights
    (`float32_master_weights`)."""
    if learning_rate is None:
        learning_rate = learning_rate_schedule(optim, total_updates)
    parts = []
    if optim.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(optim.max_grad_norm))
    parts.append(optax.adamw(learning_rate, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                             weight_decay=optim.weight_decay))
    optimizer = optax.chain(*parts)
    if jnp.dtype(param_dtype) != jnp.float32:
        optimizer = float32_master_weights(optimizer)
    return optimizer


class MasterWeightsState(NamedTuple):
    """`float32_master_weights`' state: the float32 master copy of the parameters and the
    wrapped optimizer's state, built over that copy."""

    master: optax.Params
    inner: optax.OptState


def float32_master_weights(inner: optax.GradientTransformation
                           ) -> optax.GradientTransformation:
    """`inner` run in float32 on a float32 copy of (low-precision) parameters.

    init(params): master = float32(params); the inner state is `inner.init(master)`
      (Adam's moments are then float32 whatever the parameters' dtype).
    update(grads, state, params): u, inner' = inner.update(float32(grads), inner,
      master); master' = master + u; the returned update is
      float32(round_to_param_dtype(master')) - float32(params), so
      `optax.apply_updates(params, update)` (which adds in float32 and casts back)
      gives master' rounded to the parameters' dtype: the parameters stay their master
      copy rounded, and small updates accumulate in the master copy instead of rounding
      away. (The difference of two bfloat16 numbers is exact in float32 unless they
      are more than a factor 2^15 apart, so the round trip is exact in practice.)
      (Micikevicius et al. 2018, arXiv 1710.03740.)
    """

    def as_float32(tree):
        return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)

    def init(params):
        master = as_float32(params)
        return MasterWeightsState(master=master, inner=inner.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("float32_master_weights needs the parameters: call "
                             "update(grads, state, params)")
        updates, inner_state = inner.update(as_float32(grads), state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        deltas = jax.tree.map(
            lambda m, p: (m.astype(p.dtype).astype(jnp.float32)
                          - jnp.asarray(p, jnp.float32)), master, params)
        return deltas, MasterWeightsState(master=master, inner=inner_state)

    return optax.GradientTransformation(init, update)

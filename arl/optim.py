"""The optimizer of `config.optim`, one builder for every trainer: the RL update of both
trainers, the SFT warm start and the process reward models.

    optimizer = make_optimizer(config.optim, total_updates=rl_updates(config))
    optimizer = make_optimizer(config.optim, learning_rate=3e-3)   # a constant rate

Every field means the same everywhere: global-norm clipping at `max_grad_norm` (none
when 0), then AdamW with `b1`, `b2`, `eps` and decoupled `weight_decay`, on the
learning-rate schedule of `schedule` / `warmup_steps` (or a given constant rate).
"""

from __future__ import annotations

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
                   total_updates: int = 1) -> optax.GradientTransformation:
    """Clipping then AdamW as `optim` says; the rate is `learning_rate` if given (the warm
    start's and the PRMs' own constant rates), else `optim`'s schedule over
    `total_updates` optimizer steps."""
    if learning_rate is None:
        learning_rate = learning_rate_schedule(optim, total_updates)
    parts = []
    if optim.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(optim.max_grad_norm))
    parts.append(optax.adamw(learning_rate, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                             weight_decay=optim.weight_decay))
    return optax.chain(*parts)

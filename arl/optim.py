"""The optimizer of `config.optim`: global-norm clipping, then AdamW on a schedule."""

from __future__ import annotations

import ml_collections
import optax

LR_SCHEDULES = ("constant", "linear", "cosine")


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


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """The RL update's optimizer: `config.optim` over train_steps x epochs x minibatches
    updates."""
    o = config.optim
    total = config.train_steps * config.updates.epochs * config.updates.minibatches
    parts = []
    if o.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(o.max_grad_norm))
    parts.append(optax.adamw(learning_rate_schedule(o, total), b1=o.b1, b2=o.b2,
                             weight_decay=o.weight_decay))
    return optax.chain(*parts)

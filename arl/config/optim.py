"""`config.optim`: AdamW, its learning-rate schedule and gradient clipping
(arl.optim)."""

from __future__ import annotations

import ml_collections

from arl.config.checks import check_choice, check_range
from arl.optim import LR_SCHEDULES


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.learning_rate = 1e-3
    c.schedule = "constant"
    c.warmup_steps = 0
    c.b1 = 0.9
    c.b2 = 0.99
    c.eps = 1e-8  # Adam's epsilon
    c.weight_decay = 0.0
    c.max_grad_norm = 1.0
    return c


def validate(config) -> None:
    check_range(config, "optim.learning_rate", 0.0, low_open=True)
    check_choice(config, "optim.schedule", LR_SCHEDULES)
    check_range(config, "optim.warmup_steps", 0, integer=True)
    check_range(config, "optim.max_grad_norm", 0.0)
    check_range(config, "optim.b1", 0.0, 1.0)
    check_range(config, "optim.b2", 0.0, 1.0)
    check_range(config, "optim.eps", 0.0, low_open=True)
    check_range(config, "optim.weight_decay", 0.0)

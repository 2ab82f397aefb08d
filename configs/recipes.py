"""Pieces the shipped configs share. Each sets a few related keys of a config in place
and returns it, so a config file still reads top to bottom on its own; every key's
default and meaning is in `arl.config.default_config`."""

from __future__ import annotations

import ml_collections


def warm_start(c: ml_collections.ConfigDict, *, steps: int, batch: int = 64,
               learning_rate: float = 3e-3) -> ml_collections.ConfigDict:
    """Stage 1, behaviour cloning (`arl.trainers.warm_start`, run by experiments.train on
    a fresh run and by experiments.learning_stages): `steps` SFT steps of `batch` fresh
    demonstrations of `loss.sft_source` each, AdamW at `learning_rate`. Stage 2 (RL)
    starts from those weights; experiments.train saves them as checkpoint 0."""
    c.warm_start.sft_steps = steps
    c.warm_start.sft_batch = batch
    c.warm_start.sft_lr = learning_rate
    return c


def sft_floor(c: ml_collections.ConfigDict, coef: float = 0.05,
              source: str = "demonstrator") -> ml_collections.ConfigDict:
    """RL + alpha * SFT with a small constant alpha on fresh demonstrations of `source`:
    keeps the policy near the demonstrations' format while RL improves on them."""
    c.loss.sft_coef = coef
    c.loss.sft_coef_final = -1.0
    c.loss.sft_source = source
    return c


def decaying_sft(c: ml_collections.ConfigDict, *, start: float = 1.0, final: float = 0.05,
                 decay_steps: int, hold_steps: int = 0,
                 source: str = "demonstrator") -> ml_collections.ConfigDict:
    """RL + alpha * SFT with alpha held at `start` for `hold_steps`, then decayed linearly
    to `final` over `decay_steps` (high early, lower later): the warm start and RL in one
    run."""
    c.loss.sft_coef = start
    c.loss.sft_coef_final = final
    c.loss.sft_hold_steps = hold_steps
    c.loss.sft_decay_steps = decay_steps
    c.loss.sft_source = source
    return c


def gentle_rl(c: ml_collections.ConfigDict, *, learning_rate: float = 3e-4,
              warmup_steps: int = 10) -> ml_collections.ConfigDict:
    """The RL stage after a warm start: a low constant learning rate with a linear warmup
    (a fresh Adam at 2e-3 wrecked the SFT policy within 10 steps in our measurements)."""
    c.optim.learning_rate = learning_rate
    c.optim.warmup_steps = warmup_steps
    c.optim.schedule = "constant"
    return c

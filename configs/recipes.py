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


def critic_ppo(c: ml_collections.ConfigDict, *, value_coef: float = 0.5,
               num_tasks: int = 64) -> ml_collections.ConfigDict:
    """PPO with a value head on multi-turn token tasks: `num_tasks` tasks x 1 sample (a
    critic needs no groups), 2 epochs x 2 minibatches, undiscounted turn-level GAE
    (lam 0.95, turn_gamma 0.95), whitened advantages, the value loss weighted by
    `value_coef` (lower it when returns are large: the value head shares the trunk)."""
    c.algorithm = "ppo"
    c.rollout.num_tasks = num_tasks
    c.rollout.group_size = 1
    c.updates.epochs = 2
    c.updates.minibatches = 2
    c.advantage.gamma = 1.0
    c.advantage.lam = 0.95
    c.advantage.turn_level = True
    c.advantage.turn_gamma = 0.95
    c.advantage.whiten = True
    c.loss.value_coef = value_coef
    return c

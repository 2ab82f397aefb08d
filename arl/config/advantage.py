"""`config.advantage`: GAE's discounts, turn-level GAE, the normalisation epsilon,
whitening, and ERPO's centring (arl.algorithms.advantages, arl.algorithms.group)."""

from __future__ import annotations

import ml_collections

from arl.config.checks import check_range


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.gamma = 1.0
    c.lam = 1.0
    c.turn_level = False  # PPO: bi-level (turn, then token) GAE
    c.turn_gamma = 1.0
    c.eps = 1e-6
    c.whiten = False  # PPO: whiten GAE advantages over agent tokens
    c.erpo_centre_on_env_mean = False
    return c


def validate(config) -> None:
    check_range(config, "advantage.gamma", 0.0, 1.0)
    check_range(config, "advantage.lam", 0.0, 1.0)
    check_range(config, "advantage.turn_gamma", 0.0, 1.0)
    check_range(config, "advantage.eps", 0.0, low_open=True)

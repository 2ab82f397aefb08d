"""`config.filters`: which groups and rows the update trains on (StarPO's top groups
by reward spread, DAPO's dynamic sampling, rows without signal)."""

from __future__ import annotations

import ml_collections

from arl.config.checks import check_range


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.starpo_keep_fraction = 1.0  # < 1 keeps the top fraction of groups by std
    c.dapo_zero_variance = False
    c.skip_zero_advantage = True
    return c


def validate(config) -> None:
    check_range(config, "filters.starpo_keep_fraction", 0.0, 1.0, low_open=True)

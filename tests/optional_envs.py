"""Shipped configs whose environment lives in an optional extra: skipped, with the
install line, where that extra is not installed (the `test` extra, which CI installs,
holds all three)."""

from __future__ import annotations

import pytest

# env-name prefix -> (the module the adapter imports, the extra that installs it)
_EXTRAS = {"reasoning_gym:": ("reasoning_gym", "reasoning-gym"),
           "textarena:": ("textarena", "textarena"),
           "openenv:": ("openenv.core", "openenv")}


def skip_without_extra(config) -> None:
    """pytest.skip when `config.env.name` needs a package of an extra that is absent."""
    name = str(config.env.name)
    for prefix, (module, extra) in _EXTRAS.items():
        if name.startswith(prefix):
            pytest.importorskip(module, reason=f"{name} needs pip install 'arl[{extra}]'")

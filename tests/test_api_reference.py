"""docs/api.md is what `python docs/make_api.py` writes from today's docstrings, and it
covers the public face (every name `arl` exports, `arl.setup` first among them)."""

from __future__ import annotations

import importlib.util
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_api():
    spec = importlib.util.spec_from_file_location(
        "make_api", os.path.join(_ROOT, "docs", "make_api.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_is_up_to_date():
    make_api = _make_api()
    with open(make_api.API_MD, encoding="utf-8") as f:
        stored = f.read()
    assert stored == make_api.reference(), "docs/api.md is stale: run python docs/make_api.py"
    import arl  # pylint: disable=import-outside-toplevel

    for name in arl._EXPORTS:  # pylint: disable=protected-access
        assert f"**`{name}" in stored, name
    assert "**`setup(config" in stored and "**`chosen_policy_loss(config" in stored

"""Checks of single values, shared by the sections: each failure is one `ConfigError`
line naming the field, the value and what is allowed."""

from __future__ import annotations

import math
from typing import Any

from arl.errors import invalid_field


def fail(field: str, value: Any, allowed: str) -> None:
    raise invalid_field(field, value, allowed)


def value_at(config, field: str) -> Any:
    node = config
    for part in field.split("."):
        node = node[part]
    return node


def check_range(config, field, low=None, high=None, *, low_open=False, integer=False):
    """`config.<field>` is a finite number (an integer where `integer`) in [low, high]
    (or (low, high] where `low_open`)."""
    value = value_at(config, field)
    if integer and (not isinstance(value, int) or isinstance(value, bool)):
        fail(field, value, "expected an integer")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        fail(field, value, "expected a number")
    if not math.isfinite(value):
        fail(field, value, "expected a finite number")
    if low is not None and (value <= low if low_open else value < low):
        fail(field, value, f"must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        fail(field, value, f"must be <= {high}")


def check_bool(config, field: str) -> None:
    value = value_at(config, field)
    if not isinstance(value, bool):
        fail(field, value, "allowed values are (True, False)")


def check_choice(config, field: str, allowed: tuple) -> None:
    value = value_at(config, field)
    if not isinstance(value, str) or value not in allowed:
        fail(field, value, f"allowed values are {allowed}")

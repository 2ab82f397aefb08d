"""Reward functions a user writes in plain Python, named in configs as
"tests.user_rewards:<function>" (tests/test_python_rewards.py,
tests/test_reward_functions.py)."""

from __future__ import annotations

import math
import threading
import time


def length(prompts, completions, **kwargs):
    """The completion's length in characters."""
    return [float(len(c)) for c in completions]


def echo_column(prompts, completions, weight, **kwargs):
    """The row's `weight` column (None where it is None)."""
    return [None if w is None else float(w) for w in weight]


def explodes_on_x(prompts, completions, **kwargs):
    """Raises on any batch holding an "x" completion (so each row alone is retried)."""
    if any("x" in c for c in completions):
        raise ValueError("cannot score 'x'")
    return [1.0] * len(completions)


def nan_on_y(prompts, completions, **kwargs):
    return [math.nan if "y" in c else 1.0 for c in completions]


def too_few(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def sleeps(prompts, completions, **kwargs):
    time.sleep(5.0)
    return [1.0] * len(completions)


NOT_A_FUNCTION = 3


def length_nan_on_odd(prompts, completions, **kwargs):
    """The completion's length, NaN (a failure) where it is odd."""
    return [math.nan if len(c) % 2 else float(len(c)) for c in completions]


def raises_always(prompts, completions, **kwargs):
    raise RuntimeError("the scoring service is down")


def never_returns(prompts, completions, **kwargs):
    """Hangs (a call to a service that never answers)."""
    threading.Event().wait()


def nan_on_every_row(prompts, completions, **kwargs):
    return [math.nan] * len(completions)

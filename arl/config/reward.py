"""`config.reward`: reward functions written in plain Python, added to the env's reward
(`arl.trainers.python_rewards`; docs/bring_your_task.md)."""

from __future__ import annotations

import math

import ml_collections

from arl.config.checks import check_choice, check_range, fail
from arl.rewards.functions import ON_ERROR, function_name, resolve


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # "module:function" names, e.g. ("my_rewards:formatted", "my_rewards:correct"): each
    # is called on the host once per step with the batch's prompts, completions, messages
    # and the dataset's columns, and returns one number (or None) per row. The module is
    # imported (name it in config.imports too if it registers anything). From the command
    # line: --config.reward.functions="('my_rewards:formatted','my_rewards:correct')".
    c.functions = ()
    c.weights = ()  # one per function; empty: 1.0 each
    c.env_weight = 1.0  # weight of the env's own reward (its verifier); 0: functions only
    c.timeout_s = 60.0  # time limit of one function's call on one step's batch
    # "raise": a failing function (an exception, a timeout, a non-finite or non-number
    # value) ends the run with one line naming it and the row; "zero": such rows score 0
    # and are counted (reward/<name>/errors).
    c.on_error = "raise"
    c.max_workers = 0  # threads running the calls; 0: one per function, at least 4
    return c


def validate(config) -> None:
    r = config.reward
    functions = r.functions
    if not isinstance(functions, (tuple, list)) or not all(
            isinstance(f, str) for f in functions):
        fail("reward.functions", functions,
             "expected a tuple of 'module:function' names, e.g. ('my_rewards:correct',)")
    for spec in functions:
        try:
            resolve(spec)
        except ValueError as error:
            fail("reward.functions", tuple(functions), str(error))
    names = [function_name(f) for f in functions]
    if len(set(names)) != len(names):
        fail("reward.functions", tuple(functions),
             "two functions share a name, so their metrics reward/<name> would collide")
    weights = r.weights
    if not isinstance(weights, (tuple, list)) or (weights and len(weights) != len(functions)) \
            or any(isinstance(w, bool) or not isinstance(w, (int, float))
                   or not math.isfinite(w) for w in weights):
        fail("reward.weights", weights,
             f"expected () or {len(functions)} finite numbers, one per reward.functions entry")
    check_range(config, "reward.env_weight")
    check_range(config, "reward.timeout_s", 0.0, low_open=True)
    check_choice(config, "reward.on_error", ON_ERROR)
    check_range(config, "reward.max_workers", 0, integer=True)

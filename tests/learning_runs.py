"""Helpers of the slow learning tests: the two stages of a shipped config, and the RL
batches' means over its first and last steps."""

from __future__ import annotations

import importlib

import numpy as np

from experiments import learning_stages
from tests import optional_envs


def run_shipped_config(name: str) -> dict:
    """`experiments.learning_stages.run_stages` on `configs/<name>.py` (which must warm
    start), progress printed as it runs; the result without its per-step history and curve."""
    result, _ = run_shipped_config_and_curve(name)
    return result


def run_shipped_config_and_curve(name: str) -> tuple[dict, list[dict]]:
    """(result, the RL stage's per-step curve) of `run_shipped_config`; skipped, naming
    the extra, where the config's env needs a package that is not installed."""
    config = importlib.import_module(f"configs.{name}").get_config()
    optional_envs.skip_without_extra(config)
    assert config.warm_start.sft_steps > 0
    result, _ = learning_stages.run_stages(config, log=lambda s: print(s, flush=True))
    result.pop("rl_history")
    curve = result.pop("rl_curve")
    print(result)
    return result, curve


def first_and_last(curve: list[dict], key: str, steps: int = 10) -> tuple[float, float]:
    """The mean of `key` over the first and over the last `steps` steps of a curve."""
    return (float(np.mean([row[key] for row in curve[:steps]])),
            float(np.mean([row[key] for row in curve[-steps:]])))

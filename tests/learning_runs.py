"""Helper of the slow learning tests: the two stages of a shipped config."""

from __future__ import annotations

import importlib

from experiments import learning_stages


def run_shipped_config(name: str) -> dict:
    """`experiments.learning_stages.run_stages` on `configs/<name>.py` (which must warm
    start), progress printed as it runs; the result without its per-step history and curve."""
    config = importlib.import_module(f"configs.{name}").get_config()
    assert config.warm_start.sft_steps > 0
    result, _ = learning_stages.run_stages(config, log=lambda s: print(s, flush=True))
    result.pop("rl_history")
    result.pop("rl_curve")
    print(result)
    return result

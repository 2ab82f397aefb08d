"""What the experiment loop checks so a fault ends in one line, not in a bad state: the
workdir holds this run's checkpoints (not another model's), and no step's rewards,
token ids, loss or gradients went non-finite (`arl.trainers.guards` computes the counts
inside the compiled step; `check_step` reads them on the host).

    restored = run_guards.restore_latest(ckpt, target, config_json)
    ...
    run_guards.check_step(metrics, step, config)   # raises NonFiniteStep
"""

from __future__ import annotations

import json
from typing import Any

from absl import logging
import jax
import numpy as np

from arl import config as config_lib
from arl.errors import ConfigError, RunStopped
from arl.runs import checkpoint as checkpoint_lib
from arl.trainers import guards


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``field (saved -> current)`` for every config field whose value differs between a
    checkpoint's stored config and the current one (keys added to the schema since the
    checkpoint count at their defaults, not as changes)."""
    try:
        saved = json.loads(config_lib.with_defaults(saved).to_json_best_effort())
    except ConfigError:
        pass  # a key since removed: reported as changed
    saved_flat, current_flat = _flat(saved), _flat(current)
    changed = sorted(k for k in set(saved_flat) | set(current_flat)
                     if saved_flat.get(k) != current_flat.get(k))
    return [f"{k} ({saved_flat.get(k)!r} -> {current_flat.get(k)!r})" for k in changed]


def restore_latest(ckpt: checkpoint_lib.Checkpointer, target: Any,
                   config_json: dict[str, Any]):
    """`ckpt.restore_latest(target)`; a checkpoint of another model shape or run is a
    one-line `ConfigError` naming the config fields that differ (and the arrays)."""
    try:
        return ckpt.restore_latest(target)
    except checkpoint_lib.CheckpointStructureError as error:
        found = ckpt.latest_metadata()
        step, metadata = found if found is not None else (None, {})
        fields = config_differences(metadata.get("config", {}), config_json)
        arrays = sorted((line.strip() for line in str(error).splitlines()[1:]),
                        key=lambda line: not line.startswith("params."))  # the model first
        shown = "; ".join(arrays[:2]) + (f" (+{len(arrays) - 2} more)" if len(arrays) > 2
                                         else "")
        what = (f"its config differs in {', '.join(fields)}" if fields else
                "its config is the same, but its arrays differ (the model code changed?)")
        raise ConfigError(
            f"the workdir's checkpoint {step} in {ckpt.directory} belongs to another run: "
            f"{what}; arrays: {shown}. Use a new --workdir (or the config the run was "
            "started with).") from error


class NonFiniteStep(RunStopped):
    """A step's rewards, token ids, loss or gradients were non-finite (or out of range)."""


_WHAT = {
    guards.REWARDS: "returned non-finite rewards ({count} values)",
    guards.TOKEN_IDS: "replied with token ids outside the model's vocabulary ({count} "
                      "tokens)",
    guards.LOSS: "the loss was NaN or inf",
    guards.GRADS: "the gradients were NaN or inf",
    guards.PARAMS: "the updated parameters held NaN or inf",
}


def _describe(faults: dict[str, float]) -> list[str]:
    """One phrase per non-zero fault count, naming the env where it is per env."""
    phrases = []
    order = list(_WHAT)
    for key, count in faults.items():
        if not count:
            continue
        quantity, _, env = key[len(guards.PREFIX):].partition("/")
        what = _WHAT.get(quantity, quantity).format(count=int(count))
        rank = order.index(quantity) if quantity in order else len(order)
        phrases.append((rank, f"env {env!r} {what}" if env else what))
    return [phrase for _, phrase in sorted(phrases)]


class NonFiniteGuard:
    """Reads the step's `faults/` counts (arl.trainers.guards) on the host without
    stalling the device: `step_done` checks the previous step's counts (finished by
    then) and keeps this step's; `check` checks them at once (before a checkpoint or a
    logged record, which fetch anyway). Under ``on_non_finite="stop"`` a fault raises
    `NonFiniteStep`; under "skip" the step kept its parameters and a warning says so."""

    def __init__(self, on_non_finite: str):
        self._skip = on_non_finite == "skip"
        self._pending: tuple[int, dict[str, Any]] | None = None

    def step_done(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` without the fault counts (nothing is logged of them)."""
        faults = {k: v for k, v in metrics.items() if k.startswith(guards.PREFIX)}
        self.check()
        self._pending = (step, faults)
        return {k: v for k, v in metrics.items() if not k.startswith(guards.PREFIX)}

    def check(self) -> None:
        if self._pending is None:
            return
        (step, faults), self._pending = self._pending, None
        phrases = _describe({k: float(np.asarray(v)) for k, v in jax.device_get(faults).items()})
        if not phrases:
            return
        if self._skip:
            logging.warning("Step %d: %s; its update was skipped (on_non_finite='skip').",
                            step, "; ".join(phrases))
            return
        raise NonFiniteStep(
            f"step {step}: {'; '.join(phrases)}. The run stopped before checkpointing "
            f"step {step} (its checkpoints hold finite parameters only); fix the env, or "
            "set config.on_non_finite='skip' to skip such updates.")

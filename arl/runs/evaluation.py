"""Evaluation of a trained token-environment policy: restore, roll out, tabulate.

    step, config = checkpoint_config(workdir)
    trainer = trainer_for_checkpoint(config)     # arl.trainers.build, as the run built it
    step, params = restore_params(trainer, workdir)
    traj = evaluate_policy(trainer, params, key, num_tasks=64, greedy=True)
    print(format_table({"greedy": success_table(trainer.env_names, traj)}))

Every task is played once (group size 1); success and return are averaged per
environment (mixture member) and over all tasks.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import ml_collections
import numpy as np

from arl import config as config_lib
from arl import rollout as rollout_lib
from arl.runs import checkpoint as checkpoint_lib
from arl.runs.experiment import CHECKPOINT_DIR


def checkpoint_config(workdir: str) -> tuple[int, ml_collections.ConfigDict]:
    """The newest checkpoint step in ``workdir/checkpoints`` with readable metadata, and
    the config stored in it (as written by `arl.runs.experiment.run`), keys added to the
    schema since then at their defaults (`arl.config.with_defaults`)."""
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    found = None
    if os.path.isdir(directory):
        with checkpoint_lib.Checkpointer(directory, read_only=True) as ckpt:
            found = ckpt.latest_metadata()
    if found is None or "config" not in found[1]:
        raise FileNotFoundError(f"no checkpoint with a stored config under {directory!r}")
    step, metadata = found
    return step, config_lib.with_defaults(metadata["config"])


def trainer_for_checkpoint(config: ml_collections.ConfigDict):
    """The trainer of a run's stored `config` (`arl.trainers.build`, as the run built it:
    its state is the checkpoint's layout) on this machine's devices: where the run's
    meshes need more devices than the machine has, the training mesh becomes one device
    and the rollout program shares it (playing or exporting a policy needs no particular
    layout; orbax reshards the checkpoint on restore)."""
    from arl import trainers  # pylint: disable=import-outside-toplevel

    two_programs = config_lib.uses_two_programs(config)
    rollout_devices = math.prod(config.rollout.mesh) if tuple(config.rollout.mesh) else 0
    if jax.device_count() < math.prod(config.mesh) + rollout_devices:
        config.mesh, config.rollout.mesh = (1, 1, 1), ()
    return trainers.build(config, two_programs=two_programs)


CheckpointCorruptError = checkpoint_lib.CheckpointCorruptError


def restore_params(trainer, workdir: str, step: int | None = None) -> tuple[int, Any]:
    """(step, policy parameters) of checkpoint `step` of `workdir`, by default the newest
    good one (corrupt ones, whose checksums do not verify, skipped with one warning
    each); under LoRA the base with the adapters merged in. Raises FileNotFoundError
    when there is no such checkpoint, CheckpointCorruptError when the `step` asked for
    does not verify."""
    target = trainer.abstract_state()
    with checkpoint_lib.Checkpointer(os.path.join(workdir, CHECKPOINT_DIR),
                                     read_only=True) as ckpt:
        if step is None:
            restored = ckpt.restore_latest(target)
            if restored is None:
                raise FileNotFoundError(f"no readable checkpoint under {workdir!r}")
            step, checkpoint, _ = restored
        else:
            steps = ckpt.all_steps()
            if step not in steps:
                raise FileNotFoundError(f"no checkpoint {step} in {workdir!r} "
                                        f"(steps: {steps})")
            checkpoint, _ = ckpt.restore(step, target)
    return step, trainer.policy_params(checkpoint)


def history_window(trainer):
    """The run's per-turn history window (`rollout.history="per_turn"`), or None for a run
    whose episodes are played as generated."""
    return trainer.window if trainer.config.rollout.history == "per_turn" else None


def player(window):
    """The rollout function of a run's history mode, with `arl.rollout.rollout`'s
    arguments: `rollout` as generated (`window` None), else `per_turn_rollout` keeping
    `window`, so an evaluation reads the contexts the run trained on."""
    if window is None:
        return rollout_lib.rollout
    from arl.rollout import per_turn  # pylint: disable=import-outside-toplevel

    return functools.partial(per_turn.per_turn_rollout, window=window)


def render_episode(env, episodes, row: int, window) -> str:
    """Readable text of episode `row` of what `player(window)` played."""
    if window is None:
        return rollout_lib.render_trajectory(env, episodes, row)
    from arl.trainers import per_turn  # pylint: disable=import-outside-toplevel

    return per_turn.render_samples(env.codec, episodes, row)


@functools.partial(jax.jit, static_argnames=("env", "model", "num_tasks", "sampling",
                                             "window"))
def _rollout(env, model, params, key, env_params, *, num_tasks, sampling, window):
    return player(window)(env, key, num_tasks=num_tasks, group_size=1, model=model,
                          params=params, sampling=sampling, env_params=env_params)


@functools.partial(jax.jit, static_argnames=("env", "num_tasks", "action_source", "window"))
def _scripted_rollout(env, key, env_params, *, num_tasks, action_source, window):
    return player(window)(env, key, num_tasks=num_tasks, group_size=1,
                          action_source=action_source, env_params=env_params)


def evaluate_policy(trainer, params, key: jax.Array, *, num_tasks: int, greedy: bool,
                    action_source: str = "model"):
    """Plays `num_tasks` fresh tasks once each; returns the trajectory on the host.

    action_source "oracle" / "demonstrator" plays the environment's scripted policy
    instead (the baselines of the table). A per-turn run (`rollout.history="per_turn"`)
    is played per turn, with its window: the `TurnSamples` it returns carry the fields
    `success_table` reads."""
    if not isinstance(num_tasks, int) or num_tasks < 1:
        raise ValueError(f"num_tasks must be an integer >= 1, got {num_tasks!r}")
    # The run's environment params (config.env.params applied), one row per task.
    env_params = trainer.task_params(num_tasks, 1)
    if action_source == "model":
        sampling = trainer.sampling.replace(greedy=bool(greedy))
        traj = _rollout(trainer.env, trainer.model, params, key, env_params,
                        num_tasks=num_tasks, sampling=sampling, window=history_window(trainer))
    else:
        traj = _scripted_rollout(trainer.env, key, env_params, num_tasks=num_tasks,
                                 action_source=action_source, window=history_window(trainer))
    return jax.device_get(traj)


def success_table(env_names, traj: rollout_lib.Trajectory) -> list[dict[str, Any]]:
    """One row per environment (for mixtures) plus an "all" row: tasks, success rate,
    mean return, mean turns and the format-error rate per turn."""
    env_ids = np.asarray(traj.env_ids)
    groups = [(name, env_ids == i) for i, name in enumerate(env_names)] if len(env_names) > 1 \
        else []
    groups.append(("all", np.ones_like(env_ids, bool)))
    rows = []
    for name, rows_mask in groups:
        count = int(rows_mask.sum())
        turns = np.asarray(traj.num_turns)[rows_mask]
        rows.append(dict(
            env=name, tasks=count,
            success_rate=float(np.asarray(traj.success)[rows_mask].mean()) if count else 0.0,
            return_mean=float(np.asarray(traj.episode_return)[rows_mask].mean()) if count
            else 0.0,
            turns_mean=float(turns.mean()) if count else 0.0,
            format_error_rate=float(np.asarray(traj.format_errors)[rows_mask].sum()
                                    / max(1, turns.sum())),
        ))
    return rows


def format_table(tables: dict[str, list[dict[str, Any]]]) -> str:
    """A plain-text table: one line per (policy, environment)."""
    header = f"{'policy':<14}{'env':<18}{'tasks':>6}{'success':>9}{'return':>9}" \
             f"{'turns':>7}{'fmt err':>9}"
    lines = [header, "-" * len(header)]
    for policy, rows in tables.items():
        for row in rows:
            lines.append(
                f"{policy:<14}{row['env']:<18}{row['tasks']:>6d}{row['success_rate']:>9.3f}"
                f"{row['return_mean']:>+9.3f}{row['turns_mean']:>7.2f}"
                f"{row['format_error_rate']:>9.3f}")
    return "\n".join(lines)

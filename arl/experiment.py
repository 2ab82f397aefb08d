"""The host loop of an experiment: build, resume, train, log, sample, checkpoint, plot.

    records = run(config, workdir)

1. `config_lib.validate(config, workdir=...)` rejects bad settings before compiling.
2. `build(config)` returns a `Trainer` (token environments) or a `VectorPPO`
   (``algorithm="ppo_vector"``); both expose ``init_state()`` and the jitted, donating
   ``train_step(state) -> (state, metrics)``.
3. The newest readable checkpoint in ``workdir/checkpoints`` is restored (corrupt ones are
   reported and skipped by `arl.checkpoint.Checkpointer`); otherwise training starts fresh,
   after the behaviour-cloning warm start when ``warm_start.sft_steps > 0``
   (`arl.warm_start`; its state is saved as checkpoint 0, so a resume skips it).
4. Per step: ``train_step``; every ``log_every`` steps one `jax.device_get` of the metrics
   into `MetricsWriter` (metrics.jsonl + TensorBoard); every ``sample_every`` steps (token
   envs) a greedy evaluation (``eval/*`` metrics, logged with that step) and two sampled
   trajectories rendered to ``samples/``; a checkpoint every ``checkpoint_every`` steps and
   at the end; a progress bar on a TTY.
5. ``curves.png`` from the whole metrics history.

Exact resume: everything a step computes is a function of the train state (its PRNG key
included) and the step number, so a run restarted from checkpoint k recomputes steps
k+1... bit for bit; evaluation keys are ``fold_in(key(seed), step)``, not host state.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from absl import logging
import jax
import ml_collections

from arl import checkpoint as checkpoint_lib
from arl import config as config_lib
from arl import writers as writers_lib

CHECKPOINT_DIR = "checkpoints"
CURVES_FILE = "curves.png"
CURVE_KEYS = writers_lib.DEFAULT_CURVE_KEYS + ("eval/success_rate",)
SAMPLE_ROWS = 2
_EVAL_SALT = 0x5A3C  # separates evaluation keys from the training key stream


def build(config: ml_collections.ConfigDict, *, mesh=None):
    """The trainer for `config.algorithm`: `VectorPPO` or `Trainer` (token envs)."""
    if config.algorithm == "ppo_vector":
        from arl import vector_ppo  # pylint: disable=g-import-not-at-top

        return vector_ppo.VectorPPO(config)
    from arl import train  # pylint: disable=g-import-not-at-top

    return train.Trainer(config, mesh=mesh)


def abstract_state(trainer) -> Any:
    """Orbax restore target (shapes, dtypes, shardings) of `trainer`'s state."""
    if hasattr(trainer, "abstract_state"):
        return trainer.abstract_state()
    # VectorPPO has no abstract_state: trace its init (no compilation, no allocation).
    return checkpoint_lib.abstract_state(jax.eval_shape(trainer.init_state))


def _config_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
    return json.loads(config.to_json_best_effort())


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _warn_config_changes(saved: dict[str, Any], current: dict[str, Any]) -> None:
    saved_flat, current_flat = _flat(saved), _flat(current)
    changed = sorted(k for k in set(saved_flat) | set(current_flat)
                     if saved_flat.get(k) != current_flat.get(k))
    if changed:
        logging.warning("Resuming with a config that differs from the checkpoint's in: %s",
                        ", ".join(f"{k} ({saved_flat.get(k)!r} -> {current_flat.get(k)!r})"
                                  for k in changed))


def evaluation_key(config: ml_collections.ConfigDict, step: int) -> jax.Array:
    """The key of the evaluation at `step`: a function of the seed and step only."""
    return jax.random.fold_in(jax.random.key(config.seed ^ _EVAL_SALT), step)


def _gather_rows(traj, rows: int):
    """The first `rows` rows of a trajectory as host arrays (all processes' shards)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

        traj = multihost_utils.process_allgather(traj, tiled=True)
    return jax.tree.map(lambda x: jax.device_get(x)[:rows], traj)


def sample_and_evaluate(trainer, params, step: int, writer: writers_lib.MetricsWriter
                        ) -> dict[str, Any]:
    """Greedy evaluation metrics (``eval/...``) and sampled transcripts for `step`."""
    from arl import rollout as rollout_lib  # pylint: disable=g-import-not-at-top

    greedy_key, sample_key = jax.random.split(evaluation_key(trainer.config, step))
    greedy_metrics, _ = trainer.evaluate(params, greedy_key, greedy=True)
    sampled_metrics, traj = trainer.evaluate(params, sample_key, greedy=False)
    rows = _gather_rows(traj, SAMPLE_ROWS)
    text = "\n\n".join(rollout_lib.render_trajectory(trainer.env, rows, row)
                       for row in range(min(SAMPLE_ROWS, rows.tokens.shape[0])))
    writer.write_text(step, "samples/sampled", text)
    metrics = {f"eval/{k}": v for k, v in greedy_metrics.items()}
    metrics.update({f"eval_sampled/{k}": v for k, v in sampled_metrics.items()})
    return metrics


def _warm_start(trainer, state):
    """The RL start state after `config.warm_start` (behaviour cloning,
    `arl.warm_start`)."""
    from arl import warm_start as warm_start_lib  # pylint: disable=g-import-not-at-top

    ws = trainer.config.warm_start
    log_every = max(1, min(25, ws.sft_steps // 10 or 1))
    logging.info("Warm start: %d SFT steps on %r demonstrations before RL.", ws.sft_steps,
                 ws.sft_source or trainer.config.loss.sft_source)
    return warm_start_lib.warm_start_state(trainer, state, log=logging.info,
                                           log_every=log_every)


def run(config: ml_collections.ConfigDict, workdir: str, *,
        kill_after_step: int | None = None) -> list[dict[str, Any]]:
    """Trains `config` in `workdir`, resuming from its newest good checkpoint.

    Args:
      config: an experiment config (see `arl.config.default_config`).
      workdir: output directory; created if missing, resumed if it holds checkpoints.
      kill_after_step: testing aid: after step k is fully processed (logged, sampled and,
        if due, checkpointed and committed) the process sends itself SIGKILL.

    Returns:
      The metric records this call logged (one dict per logged step, with ``step``);
      `arl.writers.read_metrics(workdir)` reads the whole history across restarts.
    """
    config_lib.validate(config, num_devices=jax.device_count(), workdir=workdir)
    os.makedirs(workdir, exist_ok=True)
    trainer = build(config)
    is_token_env = config.algorithm != "ppo_vector"
    total = config.train_steps
    metadata = {"config": _config_json(config)}

    records = []
    with checkpoint_lib.Checkpointer(
            os.path.join(workdir, CHECKPOINT_DIR), max_to_keep=config.keep_checkpoints,
            save_every=config.checkpoint_every) as ckpt:
        restored = ckpt.restore_latest(abstract_state(trainer))
        if restored is None:
            start, state = 0, trainer.init_state()
            logging.info("Starting a fresh run in %s.", workdir)
            warm = config.get("warm_start")
            if is_token_env and warm is not None and warm.sft_steps > 0:
                state = _warm_start(trainer, state)
                # Checkpoint 0 holds the post-SFT state: a resumed run restores it (or a
                # later step) and never repeats the warm start.
                ckpt.save(0, state, metadata=metadata, force=True)
        else:
            start, state, saved_metadata = restored
            logging.info("Resumed from step %d of %s.", start, workdir)
            _warn_config_changes(saved_metadata.get("config", {}), metadata["config"])
        if start >= total:
            logging.info("Checkpoint step %d >= train_steps=%d: nothing to do.", start, total)

        writer = writers_lib.MetricsWriter(
            workdir, resume_step=start if restored is not None else None)
        progress = writers_lib.ProgressBar(total, initial=min(start, total),
                                           log_every=config.log_every)
        try:
            for step in range(start + 1, total + 1):
                state, metrics = trainer.train_step(state)  # `state` was donated
                sample_due = (is_token_env and config.sample_every > 0
                              and step % config.sample_every == 0)
                if sample_due:
                    metrics = dict(metrics)
                    metrics.update(sample_and_evaluate(
                        trainer, trainer.policy_params(state), step, writer))
                if step % config.log_every == 0 or step == total or sample_due:
                    record = writer.write(step, metrics)
                    records.append(record)
                    progress.update(step, {k: record[k] for k in CURVE_KEYS if k in record})
                else:
                    progress.update(step)
                ckpt.save(step, state, metadata=metadata, force=step == total)
                if kill_after_step is not None and step == kill_after_step:
                    writer.flush()
                    logging.warning("--debug_kill_after_step=%d: sending SIGKILL.", step)
                    os.kill(os.getpid(), signal.SIGKILL)
            if start < total:
                ckpt.save(total, state, metadata=metadata, force=True)
        finally:
            progress.close()
            writer.close()

    if jax.process_index() == 0:
        try:
            history = writers_lib.read_metrics(workdir)
            writers_lib.plot_curves(history, os.path.join(workdir, CURVES_FILE), CURVE_KEYS,
                                    title=f"{config.algorithm} on {config.env.name}")
        except (OSError, ValueError) as error:  # e.g. no metrics logged at all
            logging.warning("No curves plotted: %s", error)
    return records

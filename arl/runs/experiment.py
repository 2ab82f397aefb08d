"""The experiment loop of an experiment: build, resume, train, log, sample, checkpoint, plot.

    records = run(config, workdir)

1. `arl.setup(config)` applies the process settings (compilation cache, CPU host
   settings; `arl.runs.process_settings`), then `config_lib.validate(config, workdir=...)`
   rejects bad settings before compiling.
2. `arl.trainers.build(config)` returns the trainer of the algorithm's row (a
   `TokenTrainer` or a `VectorPPO`); the loop uses only the `arl.trainers.Trainer`
   protocol: ``init_state``, ``abstract_state``, ``warm_start``, ``evaluation_report``
   and the jitted, donating ``train_step(state) -> (state, metrics)``.
3. The newest readable checkpoint in ``workdir/checkpoints`` is restored (corrupt ones are
   reported and skipped by `arl.runs.checkpoint.Checkpointer`); otherwise training starts
   fresh, after the behaviour-cloning warm start when ``warm_start.sft_steps > 0`` (its
   state is saved as checkpoint 0, so a resume skips it).
4. Per step: ``train_step``; every ``log_every`` steps one `jax.device_get` of the metrics
   into `MetricsWriter` (metrics.jsonl + TensorBoard); every ``sample_every`` steps an
   evaluation report (``eval/*`` metrics, logged with that step, and transcripts saved to
   ``samples/``); a checkpoint every ``checkpoint_every`` steps and at the end; a progress
   bar on a TTY.
5. ``curves.png`` from the whole metrics history.

With `config.rollout.policy_lag` or a `config.rollout.mesh` the steps come from
`arl.trainers.async_step` (rollout t+1 overlapped with update t); checkpoints then also
hold the behaviour parameters of the rollouts still to be consumed, from which a resumed
run recomputes them.

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

from arl import config as config_lib
from arl import trainers as trainers_lib
from arl.runs import checkpoint as checkpoint_lib
from arl.runs import process_settings
from arl.runs import writers as writers_lib
from arl.trainers import async_step
from arl.trainers import placement

CHECKPOINT_DIR = "checkpoints"
CURVES_FILE = "curves.png"
CURVE_KEYS = writers_lib.DEFAULT_CURVE_KEYS + ("eval/success_rate",)
_EVAL_SALT = 0x5A3C  # separates evaluation keys from the training key stream


def config_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
    return json.loads(config.to_json_best_effort())


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _warn_config_changes(saved: dict[str, Any], current: dict[str, Any]) -> None:
    try:  # keys added to the schema since the checkpoint are not changes
        saved = config_json(config_lib.with_defaults(saved))
    except config_lib.ConfigError:
        pass  # a key since removed: reported below as changed
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


def _compiling_note() -> str:
    """What the silence before the first logged step is (a first run compiles for tens
    of seconds on a small CPU; arl/caches.py)."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache:
        return "compiling the train step first."
    return f"compiling the train step first (or loading it from the cache in {cache})."


def _fused_steps(trainer, state):
    """(state, metrics) of each `trainer.train_step`, which donates `state`."""
    while True:
        state, metrics = trainer.train_step(state)
        yield state, metrics


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
      `arl.runs.writers.read_metrics(workdir)` reads the whole history across restarts.
    """
    process_settings.setup(config)
    config_lib.validate(config, num_devices=jax.device_count(), workdir=workdir)
    # Across processes a rollout mesh of its own takes a share of every process's
    # devices, and so does the training mesh (arl.trainers.placement); None: the default.
    trainer = trainers_lib.build(config, mesh=placement.training_mesh(config))
    two = async_step.build(trainer)  # two programs at a policy lag, or None: fused
    os.makedirs(workdir, exist_ok=True)
    total = config.train_steps
    metadata = {"config": config_json(config)}

    records = []
    with checkpoint_lib.Checkpointer(
            os.path.join(workdir, CHECKPOINT_DIR), max_to_keep=config.keep_checkpoints,
            save_every=config.checkpoint_every) as ckpt:
        restored = ckpt.restore_latest(trainer.abstract_state() if two is None
                                       else two.abstract_checkpoint())
        history = {}  # two programs: behaviour parameters by version (async_step)
        saved = (lambda state: state) if two is None else (
            lambda state: two.checkpoint(state, history))
        if restored is None:
            start, state = 0, trainer.init_state()
            logging.info("Starting a fresh run in %s; %s", workdir, _compiling_note())
            if config.warm_start.sft_steps > 0:
                state = trainer.warm_start(state, log=logging.info)
                # Checkpoint 0 holds the post-SFT state: a resumed run restores it (or a
                # later step) and never repeats the warm start.
                ckpt.save(0, saved(state), metadata=metadata, force=True)
        else:
            start, state, saved_metadata = restored
            if two is not None:
                state, history = two.restored(state)
            logging.info("Resumed from step %d of %s; %s", start, workdir, _compiling_note())
            _warn_config_changes(saved_metadata.get("config", {}), metadata["config"])
        if start >= total:
            logging.info("Checkpoint step %d >= train_steps=%d: nothing to do.", start, total)

        writer = writers_lib.MetricsWriter(
            workdir, resume_step=start if restored is not None else None)
        progress = writers_lib.ProgressBar(total, initial=min(start, total),
                                           log_every=config.log_every)
        try:
            if two is None:
                results = _fused_steps(trainer, state)
            else:  # rollout t+1 runs while update t trains
                results = two.steps(state, max(total - start, 0), history=history)
            for step, (state, metrics) in zip(range(start + 1, total + 1), results):
                sample_due = config.sample_every > 0 and step % config.sample_every == 0
                if sample_due:
                    report = trainer.evaluation_report(state, evaluation_key(config, step))
                    metrics = {**metrics, **report.metrics}
                    if report.transcript is not None:
                        writer.write_text(step, "samples/sampled", report.transcript)
                if step % config.log_every == 0 or step == total or sample_due:
                    record = writer.write(step, metrics)
                    records.append(record)
                    progress.update(step, {k: record[k] for k in CURVE_KEYS if k in record})
                else:
                    progress.update(step)
                if ckpt.should_save(step, force=step == total):
                    ckpt.save(step, saved(state), metadata=metadata, force=step == total)
                if kill_after_step is not None and step == kill_after_step:
                    writer.flush()
                    logging.warning("--debug_kill_after_step=%d: sending SIGKILL.", step)
                    os.kill(os.getpid(), signal.SIGKILL)
            if start < total:
                ckpt.save(total, saved(state), metadata=metadata, force=True)
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

"""The experiment loop of an experiment: build, resume, train, log, sample, checkpoint, plot.

    records = run(config, workdir)

1. `arl.setup(config)` applies the process settings (compilation cache, CPU host
   settings; `arl.runs.process_settings`), then `config_lib.validate(config, workdir=...)`
   rejects bad settings before compiling; the workdir's lock (`arl.runs.workdir_lock`)
   turns a second run on it away.
2. The trainer: `arl.trainers.build(config)`, the one that `arl.build(config)` returns (a
   `TokenTrainer` or a `VectorPPO`, by the algorithm's row; two overlapped programs,
   `arl.trainers.two_program`, with a policy lag or a rollout mesh). The loop uses only
   the `arl.trainers.Trainer` protocol: ``init_state``, ``abstract_state``, ``warm_start``, ``evaluation_report``
   and ``train_step(state) -> (state, metrics)``, which donates ``state``.
3. The newest readable checkpoint in ``workdir/checkpoints`` is restored (corrupt ones are
   reported and skipped by `arl.runs.checkpoint.Checkpointer`); otherwise training starts
   fresh, after the behaviour-cloning warm start when ``warm_start.sft_steps > 0`` (its
   state is saved as checkpoint 0, so a resume skips it). What an earlier run logged
   after the restored step is removed from the logs (the steps are logged again).
4. Per step: ``train_step``; every ``log_every`` steps one `jax.device_get` of the metrics
   into `MetricsWriter` (metrics.jsonl + TensorBoard); every ``sample_every`` steps an
   evaluation report (``eval/*`` metrics, logged with that step, and transcripts saved to
   ``samples/``); a checkpoint every ``checkpoint_every`` steps and at the end, each
   after the logs it covers are synced to disk; a progress bar on a TTY. SIGTERM or
   SIGINT stops the loop after the step in progress, with a checkpoint of it
   (`arl.runs.preemption`; docs/faults.md).
5. ``curves.png`` from the whole metrics history.

With two programs the state (`two_program.TwoProgramState`) also holds the behaviour
parameters of the rollouts still to be consumed, from which a resumed run recomputes
them.

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
from arl.errors import RewardFunctionError
from arl.runs import checkpoint as checkpoint_lib
from arl.runs import process_settings
from arl.runs import preemption
from arl.runs import workdir_lock
from arl.runs import run_guards
from arl.runs import writers as writers_lib

CHECKPOINT_DIR = "checkpoints"
CURVES_FILE = "curves.png"
CURVE_KEYS = writers_lib.DEFAULT_CURVE_KEYS + ("eval/success_rate",)
_EVAL_SALT = 0x5A3C  # separates evaluation keys from the training key stream


def config_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
    return json.loads(config.to_json_best_effort())


def _warn_config_changes(saved: dict[str, Any], current: dict[str, Any]) -> None:
    changed = run_guards.config_differences(saved, current)
    if changed:
        logging.warning("Resuming with a config that differs from the checkpoint's in: %s",
                        ", ".join(changed))


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


def _raise_reward_failure(trainer, error: Exception) -> None:
    """A Python reward function's failure surfaces from the step as a runtime error of
    the host callback (a traceback); raise its one line instead."""
    rewards = getattr(trainer, "python_rewards", None)
    failure = None if rewards is None or rewards.scorer.on_error != "raise" \
        else rewards.scorer.failure
    if failure is not None and not isinstance(error, RewardFunctionError):
        raise RewardFunctionError(failure) from error


def run(config: ml_collections.ConfigDict, workdir: str, *,
        kill_after_step: int | None = None) -> list[dict[str, Any]]:
    """Trains `config` in `workdir`, resuming from its newest good checkpoint.

    Args:
      config: an experiment config (see `arl.config.default_config`).
      workdir: output directory; created if missing, resumed if it holds checkpoints.
      kill_after_step: testing aid: after step k is logged, sampled and, if due,
        checkpointed, the process sends itself SIGKILL (nothing else is flushed).

    Returns:
      The metric records this call logged (one dict per logged step, with ``step``);
      `arl.runs.writers.read_metrics(workdir)` reads the whole history across restarts.

    Raises:
      arl.runs.workdir_lock.WorkdirInUseError: another process trains in `workdir`.
      arl.runs.preemption.Preempted: SIGTERM or SIGINT stopped the run after a step,
        whose checkpoint is written and whose logs are on disk.
    """
    process_settings.setup(config)
    config_lib.validate(config, num_devices=jax.device_count(), workdir=workdir)
    # Built before the workdir is made: a setting only the trainer rejects leaves nothing.
    trainer = trainers_lib.build(config)
    os.makedirs(workdir, exist_ok=True)
    with workdir_lock.hold(workdir):
        return _run_locked(trainer, config, workdir, kill_after_step)


def _run_locked(trainer, config, workdir, kill_after_step):
    total = config.train_steps
    metadata = {"config": config_json(config)}
    checkpoint_dir = os.path.join(workdir, CHECKPOINT_DIR)

    records = []
    with checkpoint_lib.Checkpointer(
            checkpoint_dir, max_to_keep=config.keep_checkpoints,
            save_every=config.checkpoint_every) as ckpt:
        restored = run_guards.restore_latest(  # another run's checkpoint: one line
            ckpt, trainer.abstract_state(), metadata["config"])
        if restored is None:
            start, state = 0, trainer.init_state()
            logging.info("Starting a fresh run in %s; %s", workdir, _compiling_note())
            if config.warm_start.sft_steps > 0:
                state = trainer.warm_start(state, log=logging.info)
                # Checkpoint 0 holds the post-SFT state: a resumed run restores it (or a
                # later step) and never repeats the warm start.
                ckpt.save(0, state, metadata=metadata, force=True)
        else:
            start, state, saved_metadata = restored
            logging.info("Resumed from step %d of %s; %s", start, workdir, _compiling_note())
            _warn_config_changes(saved_metadata.get("config", {}), metadata["config"])
        if start >= total:
            logging.info("Checkpoint step %d >= train_steps=%d: nothing to do.", start, total)

        # What a killed run logged after checkpoint `start` goes: this run logs it again.
        writer = writers_lib.MetricsWriter(workdir, resume_step=start)
        progress = writers_lib.ProgressBar(total, initial=min(start, total),
                                           log_every=config.log_every)
        guard = run_guards.NonFiniteGuard(config.on_non_finite)
        stopped_at, saved = None, False
        try:
            with preemption.StopSignals() as stop:
                for step in range(start + 1, total + 1):
                    state, metrics = trainer.train_step(state)
                    metrics = guard.step_done(step, metrics)  # NaN/inf: stop before saving
                    sample_due = config.sample_every > 0 and step % config.sample_every == 0
                    if sample_due:
                        report = trainer.evaluation_report(state, evaluation_key(config, step))
                        metrics = {**metrics, **report.metrics}
                        if report.transcript is not None:
                            writer.write_text(step, "samples/sampled", report.transcript)
                    if step % config.log_every == 0 or step == total or sample_due:
                        guard.check()
                        record = writer.write(step, metrics)
                        records.append(record)
                        progress.update(step, {k: record[k] for k in CURVE_KEYS
                                               if k in record})
                    else:
                        progress.update(step)
                    stopping = stop.requested(step)
                    force = step == total or stopping
                    if ckpt.should_save(step, force=force):
                        guard.check()
                        writer.sync()  # the records this checkpoint covers, on disk first
                        saved = ckpt.save(step, state, metadata=metadata, force=force)
                    if kill_after_step is not None and step == kill_after_step:
                        logging.warning("--debug_kill_after_step=%d: sending SIGKILL.", step)
                        os.kill(os.getpid(), signal.SIGKILL)
                    if stopping:
                        stopped_at = (stop.signum, step, saved)
                        break
                if start < total and stopped_at is None:
                    guard.check()
                    writer.sync()
                    ckpt.save(total, state, metadata=metadata, force=True)
        except Exception as error:  # pylint: disable=broad-except
            _raise_reward_failure(trainer, error)
            raise
        finally:
            progress.close()
            writer.close()
    if stopped_at is not None:
        raise preemption.Preempted(*stopped_at[:2], checkpoint_dir, saved=stopped_at[2])

    if jax.process_index() == 0:
        try:
            history = writers_lib.read_metrics(workdir)
            writers_lib.plot_curves(history, os.path.join(workdir, CURVES_FILE), CURVE_KEYS,
                                    title=f"{config.algorithm} on {config.env.name}")
        except (OSError, ValueError) as error:  # e.g. no metrics logged at all
            logging.warning("No curves plotted: %s", error)
    return records

"""The export of a run's checkpoint to a Hugging Face directory, behind the command lines
`experiments.export` and `experiments.train --export_to` (no flags defined here). Bad
input is an `absl.app.UsageError`: one line and exit status 2 under those programs."""

from __future__ import annotations

import os

from absl import app


def check_target(out: str, flag: str = "--out") -> None:
    """UsageError unless `out` is absent or an empty directory."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise app.UsageError(f"{flag}={out!r} exists and is not an empty directory")


def export_run(workdir: str, out: str, *, step: int | None = None, dtype: str | None = None):
    """(step, the written directory, {config.json field: (source, exported)} that differ)
    of exporting `workdir`'s checkpoint `step` (default: the newest good one) to `out`.
    Bad input is an `app.UsageError` (one line, exit 2 under experiments.cli)."""
    import jax

    from arl import algorithm_table
    from arl import config as config_lib
    from arl.runs import evaluation
    from arl.models import hf_export

    check_target(out)
    try:
        _, config = evaluation.checkpoint_config(workdir)
    except FileNotFoundError as error:
        raise app.UsageError(f"--workdir={workdir!r}: {error}") from error
    source = config.model.get("hf_checkpoint", "")
    if not source:
        raise app.UsageError(f"--workdir={workdir!r}: the run did not start from "
                             "config.model.hf_checkpoint, so there is no Hugging Face "
                             "directory to export next to (use "
                             "arl.models.hf_import.save_hf_checkpoint)")
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise app.UsageError(f"--workdir={workdir!r}: its source checkpoint "
                             f"{source!r} (config.model.hf_checkpoint) is gone; the export "
                             "copies its tokenizer and config.json")
    config_lib.import_modules(config)
    if algorithm_table.get_algorithm(config.algorithm).trainer == "vector":
        raise app.UsageError("experiments.export exports token-environment policies")
    trainer = evaluation.trainer_for_checkpoint(config)
    try:
        step, params = evaluation.restore_params(trainer, workdir, step)
    except (FileNotFoundError, evaluation.CheckpointCorruptError) as error:
        raise app.UsageError(f"--step={step}: {error}" if step is not None
                             else f"--workdir={workdir!r}: {error}") from error
    path = hf_export.export_checkpoint(out, jax.device_get(params), trainer.model.config,
                                       source, dtype=dtype)
    return step, path, hf_export.changed_fields(source, path)

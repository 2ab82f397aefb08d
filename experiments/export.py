r"""Exports a run's policy as a Hugging Face directory beside the checkpoint it started from.

    python -m experiments.export --workdir=/tmp/run --out=/tmp/run/hf [--step=N] \
        [--dtype=bfloat16]

The run must have started from `config.model.hf_checkpoint` (a Hugging Face directory):
the output is that directory with the trained weights (LoRA adapters merged; the value
head of a critic left out) and every other file copied (tokenizer, chat template,
generation_config.json), so `transformers.AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` load it as they loaded the source
(`arl.models.hf_export`). config.json keeps every field of the source's except the dtype
when the weights are written in another one. The newest good checkpoint is exported,
or step N. Bad input is one line on stderr and exit status 2 (experiments/cli.py).
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by experiments.train.")
_OUT = flags.DEFINE_string("out", None, "Directory to write (must not exist or be empty).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the newest).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "dtype of the written weights (default: as trained).")

flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
    del argv
    import jax

    from arl import algorithms, trainers
    from arl import config as config_lib
    from arl.host import checkpoint as checkpoint_lib
    from arl.host import evaluation
    from arl.host.experiment import CHECKPOINT_DIR
    from arl.models import hf_export

    out = _OUT.value
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise app.UsageError(f"--out={out!r} exists and is not an empty directory")
    try:
        _, config = evaluation.checkpoint_config(_WORKDIR.value)
    except FileNotFoundError as error:
        raise app.UsageError(f"--workdir={_WORKDIR.value!r}: {error}") from error
    source = config.model.get("hf_checkpoint", "")
    if not source:
        raise app.UsageError(f"--workdir={_WORKDIR.value!r}: the run did not start from "
                             "config.model.hf_checkpoint, so there is no Hugging Face "
                             "directory to export next to (use "
                             "arl.models.hf_import.save_hf_checkpoint)")
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise app.UsageError(f"--workdir={_WORKDIR.value!r}: its source checkpoint "
                             f"{source!r} (config.model.hf_checkpoint) is gone; the export "
                             "copies its tokenizer and config.json")
    config_lib.import_modules(config)
    if algorithms.get_algorithm(config.algorithm).trainer == "vector":
        raise app.UsageError("experiments.export exports token-environment policies")
    if jax.device_count() < config.mesh[0] * config.mesh[1] * config.mesh[2]:
        config.mesh = (1, 1, 1)
    trainer = trainers.build(config)
    if _STEP.value is None:
        step, params = evaluation.restore_params(trainer, _WORKDIR.value)
    else:
        with checkpoint_lib.Checkpointer(os.path.join(_WORKDIR.value, CHECKPOINT_DIR),
                                         read_only=True) as ckpt:
            steps = ckpt.all_steps()
            if _STEP.value not in steps:
                raise app.UsageError(f"--step={_STEP.value} is not a checkpoint of "
                                     f"{_WORKDIR.value!r} (steps: {steps})")
            state, _ = ckpt.restore(_STEP.value, trainer.abstract_state())
        step, params = _STEP.value, trainer.policy_params(state)
    path = hf_export.export_checkpoint(out, jax.device_get(params), trainer.model.config,
                                       source, dtype=_DTYPE.value)
    changed = hf_export.changed_fields(source, path)
    print(f"Exported step {step} of {_WORKDIR.value} to {path}"
          + (f" (config.json changed: {sorted(changed)})" if changed else ""))


if __name__ == "__main__":
    cli.run(main)

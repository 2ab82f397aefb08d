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

from absl import flags

from experiments import cli
from arl.runs.export import export_run

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by experiments.train.")
_OUT = flags.DEFINE_string("out", None, "Directory to write (must not exist or be empty).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the newest).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "dtype of the written weights (default: as trained).")

flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
    del argv
    step, path, changed = export_run(_WORKDIR.value, _OUT.value, step=_STEP.value,
                                     dtype=_DTYPE.value)
    print(f"Exported step {step} of {_WORKDIR.value} to {path}"
          + (f" (config.json changed: {sorted(changed)})" if changed else ""))


if __name__ == "__main__":
    cli.run(main)

r"""Turns a JSONL file of prompts and reference answers into a dataset for `dataset_task`.

    python -m experiments.make_dataset --input=tasks.jsonl --output=/data/tasks \
        --tokenizer=char --eval_fraction=0.1 --seed=0

Each input line is ``{"prompt": "...", "answer": "..."}``; `--input` may also be a
Parquet or CSV file or a `datasets.save_to_disk` directory, with the columns
`--prompt_key` / `--answer_key` (`arl.data.task_files`). Writes a tfds array_record
dataset with "train" and "eval" splits (`arl.data.text_tasks`) and prints its directory,
``<output>/arl_text_tasks/1.0.0``, which is what the environment takes:

    c.env.name = "dataset_task"
    c.env.kwargs.path = "/data/tasks/arl_text_tasks/1.0.0"   # or just "/data/tasks"

`--tokenizer` is "char" (arl's character vocabulary), the path of a Hugging Face
`tokenizer.json` (copied into the dataset), or a checkpoint directory (its
tokenizer.json, with the special tokens tokenizer_config.json names). Bad input (a
missing or mistyped field, invalid JSON, bytes that are not UTF-8, an empty file,
prompts or answers over `--max_prompt_len` / `--max_answer_len` tokens unless
`--drop_long` drops them; never cut) is ONE line on stderr naming the file and the first
bad line, exit status 2, and nothing is written. stdout carries only the dataset's
directory.
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments import cli

_INPUT = flags.DEFINE_string("input", None, "JSONL file of {\"prompt\", \"answer\"} lines "
                             "(or a .parquet / .csv file, a save_to_disk directory).")
_OUTPUT = flags.DEFINE_string("output", None, "Directory to write the dataset under.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "char",
                                 "'char', the path of a Hugging Face tokenizer.json, or a "
                                 "checkpoint directory.")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.1,
                                    "Fraction of the rows in the eval split, in (0, 1).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the train / eval shuffle.")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 512, "Prompt limit in tokens.")
_MAX_ANSWER_LEN = flags.DEFINE_integer("max_answer_len", 256, "Answer limit in tokens.")
_DROP_LONG = flags.DEFINE_bool("drop_long", False,
                               "Drop (and list) rows over the limits instead of failing.")
_PROMPT_KEY = flags.DEFINE_string("prompt_key", "prompt", "The input's prompt column.")
_ANSWER_KEY = flags.DEFINE_string("answer_key", "answer", "The input's answer column.")
flags.mark_flags_as_required(["input", "output"])


def codec_of(tokenizer: str):
    """The codec named by --tokenizer."""
    from arl.text.codec import CharCodec  # pylint: disable=g-import-not-at-top

    if tokenizer == "char":
        return CharCodec()
    from arl.text.hf_codec import HFCodec  # pylint: disable=g-import-not-at-top

    try:
        if os.path.isdir(tokenizer):
            return HFCodec.from_pretrained(tokenizer)
        return HFCodec(tokenizer)
    except (ValueError, OSError) as error:
        raise app.UsageError(f"--tokenizer={tokenizer!r}: {error}") from error


def main(argv):
    del argv
    from absl import logging  # pylint: disable=g-import-not-at-top

    from arl.data import text_tasks  # pylint: disable=g-import-not-at-top

    codec = codec_of(_TOKENIZER.value)
    try:
        path = text_tasks.build_text_tasks(
            _OUTPUT.value, _INPUT.value, codec=codec,
            eval_fraction=_EVAL_FRACTION.value, seed=_SEED.value,
            max_prompt_len=_MAX_PROMPT_LEN.value, max_answer_len=_MAX_ANSWER_LEN.value,
            drop_long=_DROP_LONG.value, log=logging.info,
            long_rows_advice="raise --max_prompt_len / --max_answer_len or pass --drop_long "
            "to drop them", prompt_key=_PROMPT_KEY.value, answer_key=_ANSWER_KEY.value)
    except (ValueError, FileNotFoundError) as error:  # bad input: one line, exit 2
        raise app.UsageError(str(error)) from error
    print(path)


if __name__ == "__main__":
    cli.run(main)

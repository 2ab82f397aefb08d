r"""Writes templated arithmetic word problems as JSONL (`arl.data.word_problems`).

    python -m experiments.make_arithmetic_word_problems --output=problems.jsonl \
        --num_problems=300 --seed=0

Deterministic in (num_problems, seed). The defaults reproduce the shipped
`arl/data/arithmetic_word_problems.jsonl`; turn the file into a dataset with
`python -m experiments.make_dataset --input=problems.jsonl --output=DIR --tokenizer=char`.
"""

from __future__ import annotations

from absl import app, flags

from arl.data import word_problems

_OUTPUT = flags.DEFINE_string("output", None, "Path of the JSONL file to write.")
_NUM = flags.DEFINE_integer("num_problems", word_problems.SHIPPED_COUNT,
                            "Number of distinct problems (1-2000).")
_SEED = flags.DEFINE_integer("seed", word_problems.SHIPPED_SEED, "Generator seed.")
flags.mark_flags_as_required(["output"])


def main(argv):
    del argv
    problems = word_problems.generate(_NUM.value, _SEED.value)
    word_problems.write_jsonl(_OUTPUT.value, problems)
    print(f"wrote {len(problems)} problems to {_OUTPUT.value}")


if __name__ == "__main__":
    app.run(main)

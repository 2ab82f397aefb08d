"""History modes: the cost of "per turn" against "as generated" at 2, 6 and 12 turns.

A Qwen2.5-style stand-in checkpoint (tests/hf_standins.py: 2 layers, 32 wide, a
byte-level BPE with real merges and the real chat template, built here) trains GRPO on
`guess_number` with `max_turns` = 2, 6, 12 (the untrained policy plays every turn). Each
train step (`arl.build(config).train_step`: rollout + advantages + update, one compiled
program) is timed in both modes, the modes interleaved round by round on the same
machine. Reported per step and per trained token (the agent tokens the update trains
on, equal in both modes up to sampling) and the tokens each mode's forward passes read
(as generated: one growing row per episode; per turn: every turn's whole context again).

    python benchmarks/history_modes.py [--turns 2,6,12] [--repeats 3] [--no-write]

Writes the "History modes" section of benchmarks/RESULTS.md with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import numpy as np

_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _BENCH)
import common  # noqa: E402  pylint: disable=wrong-import-position

# benchmarks/kernels.py would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _BENCH]
sys.path.insert(0, os.path.dirname(_BENCH))

import arl  # noqa: E402
from configs import grpo_hf_checkpoint  # noqa: E402
from tests import hf_standins  # noqa: E402

MODES = ("as_generated", "per_turn")


def _config(directory: str, mode: str, turns: int):
    c = grpo_hf_checkpoint.get_config(directory)
    c.model.system_prompt = "Be brief."
    c.model.dtype = c.model.param_dtype = "float32"
    c.model.remat = False
    c.model.logprob_chunk = 0
    c.env.name = "guess_number"
    c.env.kwargs = dict(max_n=1000, max_turns=turns)
    c.rollout.num_tasks = 2
    c.rollout.group_size = 4
    c.rollout.history = mode
    c.filters.skip_zero_advantage = False  # every step updates, as a learning run's do
    return c


class _Runner:
    """A compiled train step of one mode, timed per call; the last step's metrics kept."""

    def __init__(self, config):
        self.trainer = arl.build(config)
        self.state = self.trainer.init_state()
        self.metrics = None

    def __call__(self):
        self.state, metrics = self.trainer.train_step(self.state)
        self.metrics = jax.device_get(metrics)


def _read_tokens(runner, mode: str) -> float:
    """Tokens the step's rollout and update forward passes read per episode: the growing
    row's length (as generated) or every turn's whole sample (per turn)."""
    m = runner.metrics
    if mode == "as_generated":
        return float(m["context_tokens_mean"])
    turns = float(m["per_turn/samples"]) / (runner.trainer.batch_size)
    return turns * (float(m["context_tokens_mean"])
                    + float(m["response_tokens_mean"]) / max(float(m["turns_mean"]), 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="2,6,12")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    common.host_settings_as_the_cli()
    turn_counts = [int(t) for t in args.turns.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        directory = hf_standins.build_standin(os.path.join(root, "qwen2"), "qwen2")
        for turns in turn_counts:
            runners = {mode: _Runner(_config(directory, mode, turns)) for mode in MODES}
            times = common.interleaved_median_times(runners, args.repeats)
            cells = {}
            for mode in MODES:
                trained = float(runners[mode].metrics["response_tokens_mean"]) * (
                    runners[mode].trainer.batch_size)
                cells[mode] = (times[mode], times[mode] / max(trained, 1.0) * 1e3,
                               _read_tokens(runners[mode], mode))
            a, p = cells["as_generated"], cells["per_turn"]
            rows.append([turns, f"{a[0]:.2f}", f"{p[0]:.2f}", f"{p[0] / a[0]:.2f}x",
                         f"{a[1]:.2f}", f"{p[1]:.2f}", f"{a[2]:.0f}", f"{p[2]:.0f}"])
            print(rows[-1], flush=True)
    table = common.markdown_table(
        ["turns", "s/step as generated", "s/step per turn", "per turn / as generated",
         "ms/trained token as generated", "ms/trained token per turn",
         "tokens read/episode as generated", "tokens read/episode per turn"], rows)
    text = (f"`benchmarks/history_modes.py --turns {args.turns} --repeats {args.repeats}`, "
            f"{common.utc_now()}; {common.machine_line()}\n\n"
            "GRPO train steps (rollout + update, one program) of a Qwen2.5-style stand-in "
            "(2 layers x 32 wide, real merges and template) on guess_number, 2 tasks x 4 "
            "samples, the untrained policy playing every turn; median of interleaved rounds. "
            "Per turn re-reads each turn's whole context (no KV cache kept between turns) "
            "and trains every turn as its own row.\n\n" + table)
    print(table)
    if not args.no_write:
        print("wrote", common.record_section("History modes", text))


if __name__ == "__main__":
    main()

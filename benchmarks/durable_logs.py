"""What durable logs cost: the step time of a logged run, before and after.

    python benchmarks/durable_logs.py --before=73ac396 [--steps 60] [--rounds 3] [--no-write]

A logged run (`configs/grpo_bandit.py` at a tiny model, a record every step, a sample
every 10 steps, a checkpoint every `--checkpoint_every`) through
`arl.runs.experiment.run`, each run a fresh process on a fresh workdir, from two source
trees: `git archive` of `--before` (buffered metrics.jsonl, tensorboardX's queued
SummaryWriter, nothing synced) and this checkout (every record synced to disk before
the checkpoint that covers it, TensorBoard events written on the loop's thread). The
trees alternate, the order reversed every other round, after one untimed run of each
that fills the shared compilation cache. A step's time is the wall time between two
consecutive `MetricsWriter.write` calls of the run (compilation excluded): "step" is
the median over steps without a checkpoint, "checkpointed step" the median over the
steps that follow a checkpoint (the interval holds the save), "mean" all steps of the
run, the median of it over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in the child, with the tree under test first on sys.path.
_CHILD = r"""
import json, sys, time
from arl.runs import experiment, writers
from configs import grpo_bandit

steps, checkpoint_every, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
c = grpo_bandit.get_config()
c.train_steps, c.log_every, c.sample_every, c.checkpoint_every = steps, 1, 10, checkpoint_every
c.rollout.num_tasks, c.rollout.group_size = 4, 2
c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 1, 64
c.model.num_heads = c.model.num_kv_heads = 2
c.warm_start.sft_steps = 0
times = []
write = writers.MetricsWriter.write
def timed_write(self, step, metrics):
    record = write(self, step, metrics)
    times.append(time.perf_counter())
    return record
writers.MetricsWriter.write = timed_write
experiment.run(c, workdir)
print("INTERVALS " + json.dumps([b - a for a, b in zip(times, times[1:])]))
"""


def run_once(tree: str, steps: int, checkpoint_every: int, cache: str) -> dict[str, float]:
    """One run from `tree`; its step times (s)."""
    with tempfile.TemporaryDirectory(prefix="durable-logs-") as workdir:
        env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu",
               "JAX_COMPILATION_CACHE_DIR": cache,
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        result = subprocess.run(
            [sys.executable, "-c", _CHILD, str(steps), str(checkpoint_every),
             os.path.join(workdir, "run")],
            cwd=tree, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("INTERVALS ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"run from {tree} failed: {result.stderr[-3000:]}")
    # intervals[i] ends at the write of step i + 2 and holds step i + 1's checkpoint.
    intervals = json.loads(lines[0][len("INTERVALS "):])
    after_save = [s for i, s in enumerate(intervals) if (i + 1) % checkpoint_every == 0]
    plain = [s for i, s in enumerate(intervals) if (i + 1) % checkpoint_every != 0]
    return {"step": statistics.median(plain), "checkpointed": statistics.median(after_save),
            "mean": statistics.fmean(intervals)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision without durable logs")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint_every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    load_before = common.load_average()
    with tempfile.TemporaryDirectory(prefix="durable-logs-trees-") as scratch:
        before = os.path.join(scratch, "before")
        os.makedirs(before)
        archive = subprocess.run(["git", "archive", args.before], cwd=_ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", before], input=archive, check=True)
        trees = [("before", before), ("after", _ROOT)]
        cache = os.path.join(scratch, "jax_cache")
        for _, tree in trees:  # fills the compilation cache
            run_once(tree, args.steps, args.checkpoint_every, cache)
        runs = {name: [] for name, _ in trees}
        for index in range(args.rounds):
            for name, tree in trees if index % 2 == 0 else trees[::-1]:
                runs[name].append(run_once(tree, args.steps, args.checkpoint_every, cache))
    medians = {name: {k: statistics.median(r[k] for r in records) for k in records[0]}
               for name, records in runs.items()}
    rows = [[name, common.fmt_ms(m["step"]), common.fmt_ms(m["checkpointed"]),
             common.fmt_ms(m["mean"])] for name, m in medians.items()]
    rows.append(["after / before", *(f"{medians['after'][k] / medians['before'][k]:.2f}"
                                      for k in ("step", "checkpointed", "mean"))])
    description = (
        f"GRPO on the bandit at a tiny model through `experiment.run`: {args.steps} steps, "
        f"a record every step, a sample every 10, a checkpoint every "
        f"{args.checkpoint_every}; before = `{args.before}` (nothing synced), after = this "
        f"checkout (records synced before each checkpoint, events written in the loop). "
        f"{args.rounds} interleaved rounds of one process per tree, median; load average "
        f"{load_before:.1f} before, {common.load_average():.1f} after.")
    text = (common.heading("durable_logs.py") + description + "\n\n"
            + common.markdown_table(["tree", "step (ms)", "checkpointed step (ms)",
                                     "mean step (ms)"], rows))
    common.publish("Durable logs", text, write=not args.no_write)


if __name__ == "__main__":
    main()

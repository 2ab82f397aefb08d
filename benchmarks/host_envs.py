"""Host environments (`arl.envs.host`): turns per second and the share of the step spent
waiting on the host, at 1, 8 and 64 rows.

Two measurements:

1. **Scripted rollouts** of `code_interpreter` and `sql` (the oracle: one real tool call
   and one answer per episode, the result cache off so every call runs): turns / s and
   host share = seconds inside the host callbacks / wall seconds.
2. **Train steps** (`TokenTrainer.train_step`, GRPO (REINFORCE++ at one row), the
   configs' 2-layer d_model-64 decoder, an SFT term on the demonstrator so that real
   tool calls run inside the step; the untrained policy's own turns are malformed and
   cost the host nothing): turns / s (policy + demonstration turns) and host share.

    python benchmarks/host_envs.py [--rows 1,8,64] [--repeats 3] [--no-write]
                                   [--envs code_interpreter,sql] [--skip-train]

Writes the "Host environments" section of benchmarks/RESULTS.md (with the machine and its
load average: other jobs on a shared machine inflate every number, the host share least).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position

from arl import config as config_lib  # noqa: E402
from arl import envs as envs_lib  # noqa: E402
from arl import rollout as rollout_lib  # noqa: E402
from arl.trainers import TokenTrainer  # noqa: E402

ENVS = ("code_interpreter", "sql")


def _median(fn, repeats):
    fn()  # warm-up (compilation, pools, caches)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scripted_rollout(name: str, rows: int, repeats: int):
    """(turns/s, host share, seconds) of a jitted oracle rollout of `rows` episodes."""
    env = envs_lib.make(name, cache_size=0)  # every tool call runs
    run = jax.jit(lambda key: rollout_lib.rollout(env, key, num_tasks=rows, group_size=1,
                                                  action_source="oracle"))
    keys = iter(jax.random.split(jax.random.key(0), repeats + 1))
    turns = []

    def once():
        traj = jax.block_until_ready(run(next(keys)))
        turns.append(int(np.asarray(traj.num_turns).sum()))

    once()  # compile
    env.reset_host_stats()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    seconds = (time.perf_counter() - start) / repeats
    host = env.host_stats.seconds / repeats
    env.close()
    return statistics.mean(turns[1:]) / seconds, host / seconds, seconds


def _train_config(name: str, rows: int):
    c = config_lib.default_config()
    c.env.name = name
    c.env.kwargs.cache_size = 0
    groups = {1: (1, 1), 8: (4, 2), 64: (8, 8)}.get(rows)
    c.rollout.num_tasks, c.rollout.group_size = groups or (rows, 1)
    # GRPO needs groups of two or more; a single row trains with REINFORCE++ (the same
    # rollout and update, another advantage).
    c.algorithm = "grpo" if c.rollout.group_size >= 2 else "reinforce_pp"
    c.loss.sft_coef, c.loss.sft_source = 0.1, "demonstrator"
    return c


def train_steps(name: str, rows: int, repeats: int):
    """(turns/s, host share, seconds per step) of the compiled train step."""
    trainer = TokenTrainer(_train_config(name, rows))
    state = trainer.init_state()
    state, metrics = trainer.train_step(state)  # compile
    jax.block_until_ready(metrics)
    trainer.env.reset_host_stats()
    turns, start = 0.0, time.perf_counter()
    for _ in range(repeats):
        state, metrics = trainer.train_step(state)
        metrics = jax.device_get(metrics)
        turns += rows * float(metrics["turns_mean"])  # the policy's turns
    seconds = (time.perf_counter() - start) / repeats
    host = trainer.env.host_stats
    trainer.env.close()
    return turns / repeats / seconds, host.seconds / repeats / seconds, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--envs", default=",".join(ENVS))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    names = [n for n in args.envs.split(",") if n]
    load_before = common.load_average()

    rollout_rows = []
    for name in names:
        for rows in rows_list:
            rate, share, seconds = scripted_rollout(name, rows, args.repeats)
            rollout_rows.append((name, rows, f"{rate:.1f}", f"{100 * share:.0f} %",
                                 f"{seconds:.2f}"))
            print("rollout", name, rows, rate, share, seconds, flush=True)

    train_rows = []
    if not args.skip_train:
        for name in names:
            for rows in rows_list:
                rate, share, seconds = train_steps(name, rows, args.repeats)
                train_rows.append((name, rows, f"{rate:.1f}", f"{100 * share:.0f} %",
                                   f"{seconds:.2f}"))
                print("train", name, rows, rate, share, seconds, flush=True)

    load_after = common.load_average()
    text = "\n\n".join(filter(None, [
        common.heading("host_envs.py") + f"Load average {load_before:.1f} before, "
        f"{load_after:.1f} after; {args.repeats} repeats (median / mean).",
        "Oracle rollouts (one real tool call + one answer per episode, result cache off):",
        common.markdown_table(["env", "rows", "turns / s", "host share", "s / rollout"],
                              rollout_rows),
        "Train steps (GRPO, REINFORCE++ at one row, + SFT term on the demonstrator, "
        "2-layer d_model-64 decoder; turns = policy turns):" if train_rows else "",
        common.markdown_table(["env", "rows", "policy turns / s", "host share",
                               "s / step"], train_rows) if train_rows else "",
    ]))
    common.publish("Host environments", text, not args.no_write)


if __name__ == "__main__":
    main()

"""Host environments (`arl.envs.host`): turns per second and the share of the step spent
waiting on the host, at 1, 8 and 64 rows.

Three measurements:

1. **Callback overhead** (the design choice): T turns of a trivial computation whose
   "environment" is a host function that does nothing, (a) fused: one `jax.jit` program,
   a `lax.scan` over turns with one ordered `io_callback` per turn (what a host env
   does), (b) split: one jitted call per turn, the host step between calls (device_get,
   host function, the next call's transfer); (c) no host at all. Per-turn microseconds
   of (a) - (c) and (b) - (c) are what each design adds to a turn.
2. **Scripted rollouts** of `code_interpreter` and `sql` (the oracle: one real tool call
   and one answer per episode, the result cache off so every call runs): turns / s and
   host share = seconds inside the host callbacks / wall seconds.
3. **Train steps** (`TokenTrainer.train_step`, GRPO (REINFORCE++ at one row), the
   configs' 2-layer d_model-64 decoder, an SFT term on the demonstrator so that real
   tool calls run inside the step; the untrained policy's own turns are malformed and
   cost the host nothing): turns / s (policy + demonstration turns) and host share.

    python benchmarks/host_envs.py [--rows 1,8,64] [--repeats 3] [--no-write]
                                   [--envs code_interpreter,sql] [--skip-train]

Appends a section to benchmarks/RESULTS.md (with the machine and its load average:
other jobs on a shared machine inflate every number, the host share least).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

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


def callback_overhead(rows: int, turns: int = 64, width: int = 64, repeats: int = 5):
    """Per-turn microseconds added by (fused) an ordered io_callback inside a scan and
    (split) a jitted call per turn with the host step between calls, over the same
    computation without a host; `rows` x `width` int32 cross the boundary each turn."""
    x0 = jnp.zeros((rows, width), jnp.int32)

    def compute(x):
        return (x * 3 + 1) % 1000

    def host_noop(x):
        return np.asarray(x)

    def fused_turn(x, _, ordered=True):
        x = compute(x)
        x = io_callback(host_noop, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                        ordered=ordered)
        return x, None

    def plain_turn(x, _):
        return compute(x), None

    fused = jax.jit(lambda x: jax.lax.scan(fused_turn, x, None, length=turns)[0])
    unordered = jax.jit(lambda x: jax.lax.scan(
        lambda c, _: fused_turn(c, _, ordered=False), x, None, length=turns)[0])
    plain = jax.jit(lambda x: jax.lax.scan(plain_turn, x, None, length=turns)[0])
    one_turn = jax.jit(compute)

    def split():
        x = x0
        for _ in range(turns):
            x = jnp.asarray(host_noop(jax.device_get(one_turn(x))))
        return jax.block_until_ready(x)

    t_fused = _median(lambda: jax.block_until_ready(fused(x0)), repeats)
    t_unordered = _median(lambda: jax.block_until_ready(unordered(x0)), repeats)
    t_plain = _median(lambda: jax.block_until_ready(plain(x0)), repeats)
    t_split = _median(split, repeats)
    per_turn = lambda t: 1e6 * (t - t_plain) / turns  # noqa: E731
    return {"fused_us": per_turn(t_fused), "unordered_us": per_turn(t_unordered),
            "split_us": per_turn(t_split),
            "plain_us": 1e6 * t_plain / turns}


def _env(name, **kwargs):
    return envs_lib.make(name, cache_size=0, **kwargs)


def scripted_rollout(name: str, rows: int, repeats: int):
    """(turns/s, host share, seconds) of a jitted oracle rollout of `rows` episodes."""
    env = _env(name)
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

    overhead_rows = []
    for rows in rows_list:
        o = callback_overhead(rows)
        overhead_rows.append((rows, f"{o['plain_us']:.0f}", f"{o['fused_us']:.0f}",
                              f"{o['unordered_us']:.0f}", f"{o['split_us']:.0f}"))
        print("overhead", rows, o, flush=True)

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
        f"### `benchmarks/host_envs.py` — {common.utc_now()}",
        f"{common.machine_line()}; load average {load_before:.1f} before, "
        f"{load_after:.1f} after; {args.repeats} repeats (median / mean).",
        "Callback overhead per turn (microseconds; a turn's computation alone, then what "
        "an ordered io_callback inside the scan adds, and what a jitted call per turn "
        "with the host step in between adds):",
        common.markdown_table(["rows", "turn, no host", "+ fused ordered callback",
                               "+ fused unordered", "+ split (call per turn)"],
                              overhead_rows),
        "Oracle rollouts (one real tool call + one answer per episode, result cache off):",
        common.markdown_table(["env", "rows", "turns / s", "host share", "s / rollout"],
                              rollout_rows),
        "Train steps (GRPO, REINFORCE++ at one row, + SFT term on the demonstrator, "
        "2-layer d_model-64 decoder; turns = policy turns):" if train_rows else "",
        common.markdown_table(["env", "rows", "policy turns / s", "host share",
                               "s / step"], train_rows) if train_rows else "",
    ]))
    print(text)
    if not args.no_write:
        print("recorded in", common.record_section("Host environments", text))


if __name__ == "__main__":
    main()

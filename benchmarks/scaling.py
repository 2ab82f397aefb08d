"""Scaling of the GRPO train step: step time and peak memory vs batch, context, turns, group.

Each point compiles `TokenTrainer.train_step` for guess_number with a small transformer and
reports the median step time (after compilation) and XLA's planned scratch memory
(`compiled.memory_analysis().temp_size_in_bytes`, the activation / buffer peak beyond
the donated state). One axis moves at a time from a shared base point:

  * batch size B = num_tasks x group_size (group size fixed);
  * context length S: the static token buffer, grown by padding every environment reply
    with `extra` pad tokens (the `PaddedReplies` wrapper below: same task, same tokens,
    longer buffer; attention and the update run over all S positions);
  * number of turns: guess_number's `max_turns` (S grows with it: S = 1 + prompt +
    turns x (action + reply));
  * group size G at a fixed batch (num_tasks = B / G).

Also reported: lower + compile seconds for max_turns 2 vs 16, which must be nearly equal
because turns are a `lax.scan`, not an unrolled Python loop. Writes a log-log PNG.

    python benchmarks/scaling.py [--base 8,4,2,0] [--batches 32,64] [--extras 0,32]
                                 [--turns 2,16] [--groups 4,8] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position

import arl.envs as envs_lib  # noqa: E402
from arl.envs.base import TokenChunk  # noqa: E402
from arl.envs.wrappers import Wrapper  # noqa: E402
from arl.trainers import TokenTrainer  # noqa: E402

import agentic_step  # noqa: E402

PADDED_ENV = "guess_number_padded_replies"


class PaddedReplies(Wrapper):
    """guess_number whose replies are padded with `extra` pad tokens: a longer static
    context buffer for the same episodes (the padding is never part of a reply)."""

    def __init__(self, extra: int = 0, **kwargs):
        super().__init__(envs_lib.GuessNumber(**kwargs))
        self.extra = int(extra)
        self.obs_len = self.env.obs_len + self.extra

    def _pad(self, timestep):
        obs = timestep.observation
        tokens = jnp.pad(obs.tokens, (0, self.extra), constant_values=self.env.codec.pad_id)
        return timestep.replace(observation=TokenChunk(tokens=tokens, length=obs.length))

    def step(self, key, state, action, params):
        state, timestep = self.env.step(key, state, action, params)
        return state, self._pad(timestep)


def register_padded_env():
    if PADDED_ENV not in envs_lib.registered_names():
        envs_lib.register(PADDED_ENV, PaddedReplies)


def point_config(num_tasks, group_size, max_turns, extra, d_model, layers):
    c = agentic_step.make_config("grpo", num_tasks, group_size, d_model, layers)
    c.env.name = PADDED_ENV
    c.env.kwargs.max_turns = max_turns
    c.env.kwargs.extra = extra
    return c


def compile_point(config):
    """Compiles one point; its step time is measured later, interleaved with the others."""
    trainer = TokenTrainer(config)
    state = trainer.init_state()
    compiled, compile_s = common.compile_jitted(trainer.train_step, state)
    run = common.donated_step_runner(compiled, state)
    run()
    return dict(batch=trainer.batch_size, context=trainer.context_length,
                turns=config.env.kwargs.max_turns, group=config.rollout.group_size,
                temp=common.temp_bytes(compiled), compile_s=compile_s, run=run)


def ints(text):
    return [int(x) for x in text.split(",") if x]


def _span_at_least(ax, ys, factor):
    """Log y-limits spanning at least `factor`, so a nearly flat series (e.g. time vs
    group size) looks flat instead of filling the panel with a few percent of noise."""
    low, high = min(ys), max(ys)
    if high / low < factor:
        middle = (low * high) ** 0.5
        ax.set_ylim(middle / factor ** 0.5, middle * factor ** 0.5)


def plot(axes_rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axs = plt.subplots(2, len(axes_rows), figsize=(3.2 * len(axes_rows), 5.5),
                            squeeze=False)
    for j, (name, key, rows) in enumerate(axes_rows):
        xs = [r[key] for r in rows]
        step_ms = [1e3 * r["step_s"] for r in rows]
        temp_mib = [max(r["temp"] or 1, 1) / 2**20 for r in rows]
        axs[0][j].loglog(xs, step_ms, "o-", base=2)
        axs[1][j].loglog(xs, temp_mib, "s-", base=2, color="tab:red")
        for ax, ys in ((axs[0][j], step_ms), (axs[1][j], temp_mib)):
            _span_at_least(ax, ys, factor=4.0)
        axs[0][j].set_title(name)
        axs[1][j].set_xlabel(name)
    axs[0][0].set_ylabel("step time (ms)")
    axs[1][0].set_ylabel("temp memory (MiB)")
    fig.suptitle("GRPO train step, guess_number (log-log)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="8,4,2,0",
                        help="num_tasks,group_size,max_turns,extra of the shared base point")
    parser.add_argument("--batches", default="32,64", help="B values (group size fixed)")
    parser.add_argument("--extras", default="0,32", help="reply padding (context length)")
    parser.add_argument("--turns", default="2,16")
    parser.add_argument("--groups", default="4,8", help="group sizes at the base batch")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    register_padded_env()
    tasks0, group0, turns0, extra0 = ints(args.base)
    batch0 = tasks0 * group0

    cache = {}

    def point(num_tasks, group, turns, extra):
        key = (num_tasks, group, turns, extra)
        if key not in cache:
            cache[key] = compile_point(point_config(num_tasks, group, turns, extra,
                                                    args.d_model, args.layers))
            r = cache[key]
            print(f"B={r['batch']:4d} S={r['context']:4d} turns={turns:2d} G={group:2d}: "
                  f"temp {common.fmt_mib(r['temp'])} MiB, compile {r['compile_s']:.1f}s",
                  flush=True)
        return cache[key]

    axes_rows = [
        ("batch size B", "batch", [point(b // group0, group0, turns0, extra0)
                                   for b in ints(args.batches)]),
        ("context length S", "context", [point(tasks0, group0, turns0, e)
                                         for e in ints(args.extras)]),
        ("turns", "turns", [point(tasks0, group0, t, extra0) for t in ints(args.turns)]),
        ("group size G", "group", [point(batch0 // g, g, turns0, extra0)
                                   for g in ints(args.groups)]),
    ]
    # Every point timed round-robin in the same rounds, so load from other processes hits
    # all points alike (points compiled minutes apart would otherwise be incomparable).
    times = common.interleaved_median_times({k: r["run"] for k, r in cache.items()},
                                            args.repeats)
    for k, r in cache.items():
        r["step_s"] = times[k]
    png = os.path.join(common.output_dir(), "scaling.png")
    plot(axes_rows, png)

    rows = []
    for name, _, points in axes_rows:
        for r in points:
            rows.append((name, r["batch"], r["context"], r["turns"], r["group"],
                         common.fmt_ms(r["step_s"]), common.fmt_mib(r["temp"]),
                         f"{r['compile_s']:.1f}"))
    table = common.markdown_table(
        ["axis", "B", "S", "turns", "G", "step (ms)", "temp MiB", "lower+compile (s)"], rows)
    turns = {r["turns"]: r["compile_s"] for r in axes_rows[2][2]}
    compile_line = ""
    if len(turns) >= 2:
        lo, hi = min(turns), max(turns)
        compile_line = (f"\nCompile time max_turns {lo} vs {hi}: {turns[lo]:.1f} s vs "
                        f"{turns[hi]:.1f} s (ratio {turns[hi] / turns[lo]:.2f}; turns are a "
                        f"`lax.scan`).\n")
    text = (common.heading("scaling.py")
            + f"GRPO on guess_number (max_n 16), transformer d_model {args.d_model}, "
            f"{args.layers} layers; base point num_tasks {tasks0}, group {group0}, "
            f"{turns0} turns, reply padding {extra0}; median of {args.repeats} rounds, all "
            f"points interleaved. Plot: `{os.path.basename(png)}`.\n\n{table}\n{compile_line}")
    common.publish("Scaling of the token train step", text, not args.no_write)
    return axes_rows


if __name__ == "__main__":
    main()

"""Agentic LM train step (GRPO and PPO on guess_number, small transformer): throughput.

For each algorithm, in one process:
  * the full compiled `TokenTrainer.train_step` (rollout + signals + update, state donated);
  * the rollout alone (`arl.rollout.rollout` under its own `jax.jit`, same sizes), so
    rollout share = rollout time / step time and update share = the rest;
  * generated tokens / s (agent tokens sampled per step / step time) and trained tokens
    / s (context positions through forward + backward per step / step time);
  * model FLOPs utilisation: analytic executed FLOPs of the step / step time, against the
    peak FLOP/s of a large float32 `jnp.dot` measured in the same run.

FLOP count (static shapes: every row runs every position of the [B, S] buffer):
  per position, one forward = `harness.forward_flops` (2 P + 4 L S d, P counted from
  the parameters: all but the embedding table; attention over the S key slots); the
  rollout runs one forward per position (prefill and KV-cached decoding, keys = the
  cache's S slots); the update runs
  forward + backward = 3 forwards per position per epoch (plus the reference forward when
  a KL term is on; PPO's old values come from the rollout).

    python benchmarks/agentic_step.py [--num-tasks 8] [--group-size 4] [--d-model 64]
                                      [--layers 2] [--peak-size 1024] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import harness  # noqa: E402  pylint: disable=wrong-import-position

from arl import config as config_lib  # noqa: E402
from arl.trainers import TokenTrainer  # noqa: E402


def make_config(algorithm, num_tasks, group_size, d_model, layers, max_turns=None,
                mlp_ratio=4, heads=0):
    """GRPO / PPO on guess_number with a d_model x layers transformer (heads = 0:
    d_model // 16, i.e. head dim 16)."""
    c = config_lib.default_config()
    c.algorithm = algorithm
    c.env.name = "guess_number"
    if max_turns is not None:
        c.env.kwargs.max_turns = max_turns
    c.rollout.num_tasks = num_tasks
    c.rollout.group_size = group_size
    c.model.d_model = d_model
    c.model.num_layers = layers
    c.model.num_heads = heads or max(1, d_model // 16)
    c.model.num_kv_heads = c.model.num_heads
    c.model.mlp_dim = mlp_ratio * d_model
    c.filters.skip_zero_advantage = False  # always time a real update
    if algorithm == "ppo":
        c.advantage.gamma = 1.0
        c.advantage.lam = 0.95
    return c


def step_flops(trainer: TokenTrainer, params) -> dict:
    c = trainer.config
    s = trainer.context_length
    b = trainer.batch_size
    per_position = harness.forward_flops(harness.matmul_params_of_tree(params),
                                         c.model.num_layers, s, c.model.d_model)
    rollout = per_position * b * s
    # PPO's old values are recorded by the rollout (no extra forward since ea77b44).
    update_forwards = 3 * c.updates.epochs + (1 if trainer.uses_reference else 0)
    update = per_position * b * s * update_forwards
    return dict(rollout=rollout, update=update, total=rollout + update)


def rollout_program(trainer: TokenTrainer):
    """The train step's own rollout (`TokenTrainer.rollout`), compiled on its own."""
    return jax.jit(lambda params, key: trainer.rollout(params, key, trainer.horizon(0)))


def measure(config, repeats: int, peak: float) -> dict:
    trainer = TokenTrainer(config)
    state = trainer.init_state()
    params_copy = jax.tree.map(lambda x: x.copy(), state.params)  # state is donated
    flops = step_flops(trainer, params_copy)
    step, step_compile = common.compile_jitted(trainer.train_step, state)
    roll, roll_compile = common.compile_jitted(rollout_program(trainer), params_copy,
                                               jax.random.key(1))
    step_metrics = []
    run_step = common.donated_step_runner(step, state, step_metrics.append)

    keys = iter(jax.random.split(jax.random.key(2), 4 * repeats + 4))

    def run_rollout():
        jax.block_until_ready(roll(params_copy, next(keys)))

    run_step()
    run_rollout()  # first executions outside the timing
    t = common.interleaved_median_times({"step": run_step, "rollout": run_rollout}, repeats)
    generated = np.mean([float(m["response_tokens_mean"]) for m in step_metrics])
    generated *= trainer.batch_size
    trained = trainer.batch_size * trainer.context_length * config.updates.epochs
    return dict(
        algorithm=config.algorithm, batch=trainer.batch_size, context=trainer.context_length,
        step_s=t["step"], rollout_s=t["rollout"], step_compile=step_compile,
        rollout_compile=roll_compile,
        generated_per_s=generated / t["step"], trained_per_s=trained / t["step"],
        flops=flops, mfu=flops["total"] / t["step"] / peak,
        rollout_mfu=flops["rollout"] / t["rollout"] / peak,
        temp_bytes=common.temp_bytes(step))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithms", default="grpo,ppo")
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=0, help="0: d_model // 16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-size", type=int, default=1024,
                        help="side of the square float32 matmul that measures the peak")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    peak = common.matmul_peak_flops(args.peak_size)
    print(f"measured float32 matmul peak ({args.peak_size}^2): {peak / 1e9:.1f} GFLOP/s",
          flush=True)
    rows = []
    for algorithm in args.algorithms.split(","):
        config = make_config(algorithm, args.num_tasks, args.group_size, args.d_model,
                             args.layers, heads=args.heads)
        r = measure(config, args.repeats, peak)
        rows.append(r)
        print(f"{algorithm}: step {common.fmt_ms(r['step_s'])} ms, rollout "
              f"{common.fmt_ms(r['rollout_s'])} ms, MFU {100 * r['mfu']:.2f}%", flush=True)
    peak_after = common.matmul_peak_flops(args.peak_size)
    table = common.markdown_table(
        ["algorithm", "B x S", "step (ms)", "rollout alone (ms)", "rollout share",
         "update share", "generated tok/s", "trained tok/s", "step GFLOP", "MFU",
         "rollout MFU", "temp MiB", "compile step / rollout (s)"],
        [(r["algorithm"], f"{r['batch']} x {r['context']}", common.fmt_ms(r["step_s"]),
          common.fmt_ms(r["rollout_s"]), f"{r['rollout_s'] / r['step_s']:.0%}",
          f"{max(0.0, 1 - r['rollout_s'] / r['step_s']):.0%}",
          common.fmt_rate(r["generated_per_s"]), common.fmt_rate(r["trained_per_s"]),
          f"{r['flops']['total'] / 1e9:.2f}", f"{100 * r['mfu']:.2f}%",
          f"{100 * r['rollout_mfu']:.2f}%", common.fmt_mib(r["temp_bytes"]),
          f"{r['step_compile']:.0f} / {r['rollout_compile']:.0f}") for r in rows])
    text = (common.heading("agentic_step.py")
            + f"guess_number (max_n 16, 6 turns), transformer d_model {args.d_model}, "
            f"{args.layers} layers, {args.heads or max(1, args.d_model // 16)} heads, MLP {4 * args.d_model}; "
            f"{args.num_tasks} tasks x group {args.group_size}; 1 epoch x 1 minibatch; median "
            f"of {args.repeats} interleaved rounds. Measured float32 matmul peak "
            f"({args.peak_size}^2 `jnp.dot`): {peak / 1e9:.1f} GFLOP/s before, "
            f"{peak_after / 1e9:.1f} after (MFU uses the first). FLOPs are executed "
            f"model FLOPs of the static program (see the script's docstring).\n\n{table}\n")
    common.publish("Agentic LM step (token env, small transformer)", text, not args.no_write)
    return rows


if __name__ == "__main__":
    main()

"""Sharding overhead: the same GRPO train step on a (1, 1, 1) mesh vs larger meshes.

The 8 devices are fake CPU devices (`--xla_force_host_platform_device_count=8`, set here
before JAX starts its backend) sharing the same cores, so this measures what sharding costs
(partitioned program, collectives, per-device launch overhead), not a speedup: the ratio
t(mesh) / t(1 device) is the overhead factor. By default the batch is split over the
"data" axis with parameters replicated, (8, 1, 1); `--meshes` adds other (data, fsdp,
tensor) layouts, e.g. FSDP (parameters and optimizer state sharded over "fsdp", batch
over data x fsdp) or tensor parallelism (heads and MLP width over "tensor"). On a real
multi-chip machine the same script with `--devices N` compares 1 vs N chips.

    python benchmarks/sharding_overhead.py [--devices 8] [--meshes "8,1,1;2,4,1;2,2,2"]
                                           [--num-tasks 8] [--group-size 4] [--no-write]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
    common.force_host_devices(sys.argv[1:], default=8)

import agentic_step  # noqa: E402

from arl import sharding as sharding_lib  # noqa: E402
from arl.trainers import TokenTrainer  # noqa: E402


def sharded_trainer(mesh: tuple, num_tasks, group_size, d_model, layers):
    config = agentic_step.make_config("grpo", num_tasks, group_size, d_model, layers)
    config.mesh = mesh
    trainer = TokenTrainer(config, mesh=sharding_lib.make_mesh(mesh))
    state = trainer.init_state()
    compiled, compile_s = common.compile_jitted(trainer.train_step, state)
    return trainer, state, compiled, compile_s


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--meshes", default=None,
                        help='(data, fsdp, tensor) layouts compared with (1, 1, 1), ";"-'
                             'separated, e.g. "8,1,1;2,4,1;2,2,2"; default "DEVICES,1,1"')
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if jax.device_count() < args.devices:
        raise SystemExit(f"--devices={args.devices} but only {jax.device_count()} devices "
                         "exist (set XLA_FLAGS before JAX is imported)")

    meshes = [(1, 1, 1)] + common.parse_meshes(args.meshes or f"{args.devices},1,1")
    for mesh in meshes:
        if math.prod(mesh) > jax.device_count():
            raise SystemExit(f"--meshes: {mesh} needs {math.prod(mesh)} devices, only "
                             f"{jax.device_count()} exist (raise --devices)")

    runs, compile_s = {}, {}
    for mesh in dict.fromkeys(meshes):
        _, state, compiled, compile_s[mesh] = sharded_trainer(
            mesh, args.num_tasks, args.group_size, args.d_model, args.layers)
        runs[mesh] = common.donated_step_runner(compiled, state)
        runs[mesh]()
    t = common.interleaved_median_times(runs, args.repeats)
    ratios = {mesh: t[mesh] / t[(1, 1, 1)] for mesh in t}
    device = jax.devices()[0]
    table = common.markdown_table(
        ["mesh (data, fsdp, tensor)", "devices", "step (ms)", "t(mesh) / t(1 device)",
         "lower+compile (s)"],
        [(str(mesh), math.prod(mesh), common.fmt_ms(t[mesh]), f"{ratios[mesh]:.2f}",
          f"{compile_s[mesh]:.1f}") for mesh in t])
    text = (common.heading("sharding_overhead.py")
            + f"GRPO on guess_number, {args.num_tasks} tasks x group {args.group_size} (batch "
            f"{args.num_tasks * args.group_size}), transformer d_model "
            f"{args.d_model}, {args.layers} layers; median of {args.repeats} interleaved "
            f"rounds. {jax.device_count()} {device.platform} devices"
            f"{' (fake host devices sharing the same cores)' if device.platform == 'cpu' else ''}"
            f".\n\n{table}\n")
    common.publish("Sharding overhead", text, not args.no_write)
    return t, ratios


if __name__ == "__main__":
    main()

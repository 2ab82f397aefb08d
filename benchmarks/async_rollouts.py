"""Step throughput of asynchronous rollouts (`arl.trainers.two_program`) on a host-bound
environment: the fused step against the two-program loop at policy lag 0, 1 and 2, with
the rollout on its own device (disaggregated) or on the training device (colocated), and
the bound max(rollout, update) the overlap can reach.

    python benchmarks/async_rollouts.py [--steps 4] [--rounds 3] [--tiny] [--no-write]

Setting: `configs/grpo_code_interpreter.py` (GRPO + SFT floor on fresh demonstrations of
the Python-tool environment) at a tiny model, with the tool's result cache off, so every
demonstration cell runs in the sandbox: the update program plays the demonstrator's
episodes and waits on the tool (host time), the rollout program decodes (compute). On the
CPU two fake devices (`--xla_force_host_platform_device_count=2`, set here) stand for two
accelerators (`--devices`; on an accelerator machine with one chip both programs share it).
Each mode runs `--steps` steps per round, round-robin over `--rounds`
rounds (the machine's load hits all alike); the table shows median ms per step, the
ratio to the fused step, and the ratio to the bound max(R, U) of the two programs timed
alone (R: rollout, U: update, each blocked on). Pipeline fill (the first rollout of each
mode's turn, not overlapped: the modes take turns on one trainer) is included, spread
over `--steps` steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs
import common  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
    common.force_host_devices(sys.argv[1:], default=2)

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position


def tiny_config(tiny: bool):
    from configs import grpo_code_interpreter  # pylint: disable=import-outside-toplevel

    c = grpo_code_interpreter.get_config()
    c.env.kwargs.cache_size = 0  # every demonstration cell runs in the sandbox
    c.warm_start.sft_steps = 0
    c.rollout.num_tasks, c.rollout.group_size = (2, 2) if tiny else (8, 4)
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 1, 64
    c.model.num_heads = c.model.num_kv_heads = 2
    c.mesh = (1, 1, 1)
    c.rollout.mesh = (1, 1, 1) if jax.device_count() >= 2 else ()
    c.rollout.policy_lag = 1
    c.loss.off_policy_correction = "tis"
    return c


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="fake CPU devices")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="smallest batch (a script check)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel
    from arl.trainers.two_program import TwoProgramTrainer  # pylint: disable=import-outside-toplevel

    config = tiny_config(args.tiny)
    trainer = TokenTrainer(config)
    disaggregated = TwoProgramTrainer(trainer)
    colocated = (TwoProgramTrainer(trainer, mesh=trainer.mesh)
                 if disaggregated.mesh is not trainer.mesh else disaggregated)
    load_before = common.load_average()

    states = {}

    def fused():
        state = states.pop("fused", None) or trainer.init_state()
        for _ in range(args.steps):
            state, metrics = trainer.train_step(state)
        jax.block_until_ready((state, metrics))
        states["fused"] = state

    def pipelined(name, two, lag):
        def run():
            two.policy_lag = lag
            state = states.pop(name, None) or two.init_state()  # continues its last run
            for _ in range(args.steps):
                state, metrics = two.train_step(state)
            jax.block_until_ready((state, metrics))
            states[name] = state
        return run

    # Disaggregated where there are two devices (the rollout on the second); on one
    # accelerator both programs share it.
    placement = "disaggregated" if disaggregated.mesh is not trainer.mesh else "colocated"
    modes = {
        "fused step (one program)": fused,
        f"two programs, lag 0, {placement}": pipelined("lag0", disaggregated, 0),
        f"two programs, lag 1, {placement}": pipelined("lag1", disaggregated, 1),
        f"two programs, lag 2, {placement}": pipelined("lag2", disaggregated, 2),
    }
    if placement == "disaggregated":
        modes["two programs, lag 1, colocated"] = pipelined("lag1c", colocated, 1)

    # The two programs alone, each waited on: R and U of the bound max(R, U).
    probe = trainer.init_state()
    behaviour = disaggregated.behaviour_params(probe)
    key = disaggregated.state_key(probe)
    traj = jax.block_until_ready(disaggregated.rollout(behaviour, key, jnp.int32(0)))
    moved = disaggregated.to_training(traj)

    def rollout_alone():
        jax.block_until_ready(disaggregated.rollout(behaviour, key, jnp.int32(0)))

    def update_alone():
        state = states.pop("probe", None) or trainer.init_state()
        state, metrics = disaggregated.update(state, moved, jnp.int32(0))
        jax.block_until_ready((state, metrics))
        states["probe"] = state

    for fn in modes.values():  # compile
        fn()
    times = {name: [] for name in modes}
    phases = {"R": [], "U": []}
    for _ in range(args.rounds):
        for name, fn in modes.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) / args.steps)
        for label, fn in (("R", rollout_alone), ("U", update_alone)):
            fn()
            start = time.perf_counter()
            fn()
            phases[label].append(time.perf_counter() - start)
    step = {name: statistics.median(ts) for name, ts in times.items()}
    rollout_s, update_s = (statistics.median(phases["R"]), statistics.median(phases["U"]))
    bound = max(rollout_s, update_s)
    fused_s = step["fused step (one program)"]
    rows = [[name, common.fmt_ms(s), f"{fused_s / s:.2f}x", f"{s / bound:.2f}"]
            for name, s in step.items()]
    rows.append(["bound max(R, U)", common.fmt_ms(bound), f"{fused_s / bound:.2f}x", "1.00"])
    rows.append(["R + U (no overlap)", common.fmt_ms(rollout_s + update_s),
                 f"{fused_s / (rollout_s + update_s):.2f}x",
                 f"{(rollout_s + update_s) / bound:.2f}"])
    stats = trainer.env.host_stats
    description = (
        f"GRPO + SFT floor on code_interpreter, batch {trainer.batch_size} rows, tool cache "
        f"off; rollout alone R = {common.fmt_ms(rollout_s)} ms, update alone U = "
        f"{common.fmt_ms(update_s)} ms (its demonstrations' sandboxed cells: "
        f"{stats.live_rows} rows stepped on the host in {stats.seconds:.1f} s of callbacks "
        f"over the whole run); {args.steps} steps x {args.rounds} interleaved rounds, median; load "
        f"average {load_before:.1f} before, {common.load_average():.1f} after. Speed-up: "
        f"fused step time / this; vs bound: this / max(R, U).")
    text = (common.heading("async_rollouts.py") + description + "\n\n"
            + common.markdown_table(["mode", "ms / step", "speed-up vs fused", "vs bound"],
                                    rows))
    common.publish("Asynchronous rollouts", text, write=not args.no_write)


if __name__ == "__main__":
    main()

"""Which program goes out first at a policy lag: a rollout that waits on a host tool,
dispatched before or after the update it should overlap (`arl.trainers.two_program`).

    python benchmarks/dispatch_order.py [--wait_ms 20] [--steps 4] [--rounds 5] [--no-write]

Setting: GRPO on `code_interpreter` at a small model (an ECHO term so that no update is
skipped, a learning rate of 1e-9 so that every rollout makes the first one's host calls), no SFT term (the
update never calls the host), the tool's result cache off, and every host turn made to wait `--wait_ms`
(`time.sleep` around the environment's `host_step`, in the environment's thread pool: a
tool that waits rather than computes, as a remote sandbox or an API does). The rollout
then holds the dispatching thread for its whole duration (XLA:CPU runs a program with
host callbacks synchronously). Two fake CPU devices, the rollout on the second. Modes, in
interleaved rounds (each continuing its own run, pipeline full), median ms per step: the fused step; two programs at lag 0; lag 1 with
the rollout dispatched first (how the loop ran before) and with the update first (what
`TwoProgramTrainer.rollout_first` chooses here); R and U, each program alone.
"""

from __future__ import annotations

import argparse
import functools
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


def config():
    from configs import grpo_code_interpreter  # pylint: disable=import-outside-toplevel

    c = grpo_code_interpreter.get_config()
    c.env.kwargs.cache_size = 0
    c.warm_start.sft_steps = 0
    c.loss.sft_coef = 0.0  # the update stays on the device
    c.loss.echo_coef = 0.1  # and is never skipped (a random policy's groups are all 0)
    c.rollout.num_tasks, c.rollout.group_size = 4, 4
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 64, 2, 256
    c.model.num_heads = c.model.num_kv_heads = 2
    c.updates.epochs = 1
    # The policy barely moves: every rollout makes the same host calls as the first.
    c.optim.learning_rate = 1e-9
    c.mesh = (1, 1, 1)
    c.rollout.mesh = (1, 1, 1) if jax.device_count() >= 2 else ()
    c.rollout.policy_lag = 1
    c.loss.off_policy_correction = "tis"
    return c


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="fake CPU devices")
    parser.add_argument("--wait_ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel
    from arl.trainers.two_program import TwoProgramTrainer  # pylint: disable=import-outside-toplevel

    trainer = TokenTrainer(config())
    env = trainer.env
    host_step = env.host_step

    @functools.wraps(host_step)
    def waiting_host_step(*step_args, **kwargs):
        time.sleep(args.wait_ms / 1e3)
        return host_step(*step_args, **kwargs)

    env.host_step = waiting_host_step
    load_before = common.load_average()
    two = TwoProgramTrainer(trainer)
    states = {}

    def fused():
        state = states.pop("fused", None) or trainer.init_state()
        for _ in range(args.steps):
            state, metrics = trainer.train_step(state)
        jax.block_until_ready((state, metrics))
        states["fused"] = state

    aheads = {}

    def pipelined(name, lag, rollout_first):
        # pylint: disable=protected-access
        def run():
            two.policy_lag = lag
            two._rollout_first = rollout_first
            # The modes share one trainer: each continues its own run, with the rollout
            # its last step dispatched (no pipeline refill per call).
            two._ahead = aheads.pop(name, None)
            state = states.pop(name, None) or two.init_state()
            for _ in range(args.steps):
                state, metrics = two.train_step(state)
            jax.block_until_ready((state, metrics))
            states[name], aheads[name] = state, two._ahead
        return run

    state = two.init_state()
    chosen = two.rollout_first((state.behaviour[0], two.state_key(state.state), jnp.int32(1)),
                               (state.state, two.to_training(two.rollout(
                                   state.behaviour[0], two.state_key(state.state),
                                   jnp.int32(0))), jnp.int32(0)))
    modes = {
        "fused step (one program)": fused,
        "two programs, lag 0": pipelined("lag0", 0, None),
        "lag 1, rollout dispatched first": pipelined("rollout_first", 1, True),
        "lag 1, update dispatched first": pipelined("update_first", 1, False),
    }
    probe = trainer.init_state()
    behaviour, key = two.behaviour_params(probe), two.state_key(probe)
    moved = two.to_training(jax.block_until_ready(two.rollout(behaviour, key, jnp.int32(0))))

    def rollout_alone():
        jax.block_until_ready(two.rollout(behaviour, key, jnp.int32(0)))

    def update_alone():
        state = states.pop("probe", None) or trainer.init_state()
        state, metrics = two.update(state, moved, jnp.int32(0))
        jax.block_until_ready((state, metrics))
        states["probe"] = state

    for fn in (*modes.values(), rollout_alone, update_alone):  # compile
        fn()
    times = {name: [] for name in modes}
    phases = {"R": [], "U": []}
    for index in range(args.rounds):
        order = list(modes.items())
        for name, fn in order if index % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) / args.steps)
        for label, fn in (("R", rollout_alone), ("U", update_alone)):
            start = time.perf_counter()
            fn()
            phases[label].append(time.perf_counter() - start)
    step = {name: statistics.median(ts) for name, ts in times.items()}
    rollout_s, update_s = statistics.median(phases["R"]), statistics.median(phases["U"])
    lag0 = step["two programs, lag 0"]
    rows = [[name, common.fmt_ms(s), f"{s / lag0:.2f}"] for name, s in step.items()]
    rows.append(["bound max(R, U)", common.fmt_ms(max(rollout_s, update_s)),
                 f"{max(rollout_s, update_s) / lag0:.2f}"])
    rows.append(["R + U", common.fmt_ms(rollout_s + update_s),
                 f"{(rollout_s + update_s) / lag0:.2f}"])
    description = (
        f"GRPO on code_interpreter without an SFT term, batch {trainer.batch_size} rows, "
        f"every host turn waits {args.wait_ms:g} ms; rollout alone R = "
        f"{common.fmt_ms(rollout_s)} ms, update alone U = {common.fmt_ms(update_s)} ms; "
        f"`rollout_first` chose {'the rollout' if chosen else 'the update'} first. "
        f"{args.steps} steps x {args.rounds} interleaved rounds, median; load average {load_before:.1f} before, {common.load_average():.1f} "
        "after.")
    text = (common.heading("dispatch_order.py") + description + "\n\n"
            + common.markdown_table(["mode", "ms / step", "vs lag 0"], rows))
    common.publish("Dispatch order at a policy lag", text, write=not args.no_write)


if __name__ == "__main__":
    main()

"""Slot scheduling against lockstep rollouts (`rollout.schedule`, `arl.rollout.slots`):
trained tokens and finished episodes per second of whole GRPO steps (rollout + update).

    python benchmarks/continuous_batching.py [--steps 2] [--rounds 3] [--slots 0.25]
        [--workloads long_tail,guess_number,countdown] [--tiny] [--no-write]
        [--rollout-only]

Workloads: `long_tail` (benchmarks/long_tail_env.py: each episode's number of turns drawn
from a Pareto tail whose p99 is 10x its median, capped at max_turns), `guess_number` and
`countdown` as shipped (configs/grpo_*.py, no warm start), each at the same tiny model.
Arms: lockstep, and slots with each `--slots` fraction x (num_tasks * group_size)
generation rows. With
nothing carried over both play the same episodes from the same keys (the same trained
tokens); they differ in how the decoding is scheduled. Each arm runs `--steps` steps per
round, round-robin over `--rounds` rounds; medians. The table also gives each
workload's episode tokens (median, p99 : median) and the slots' busy share (decoding
slot-steps / (slots x decode iterations)).

`--rollout-only` times the step's rollout alone (no update) and adds where its time goes:
decode iterations (lockstep: max_turns x action_len, its turns scan their whole budget;
slots: `SlotStats.iterations`) and milliseconds per iteration; its own section,
"Continuous batching: where the rollout's time goes".
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

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

WORKLOADS = ("long_tail", "guess_number", "countdown")


def workload_config(name: str, tiny: bool):
    """The GRPO config of a workload at the benchmark's model and batch."""
    from configs import grpo_countdown, grpo_guess_number  # pylint: disable=import-outside-toplevel
    from arl import config as config_lib  # pylint: disable=import-outside-toplevel

    if name == "long_tail":
        c = config_lib.default_config()
        c.algorithm = "grpo"
        c.imports = ("benchmarks.long_tail_env",)
        c.env.name = "long_tail"
        # Median 2 turns (ceil of a Pareto draw of median 1.5), p99 20: 10 : 1.
        c.env.kwargs.max_turns = 8 if tiny else 24
        c.env.kwargs.action_len = 8
        c.env.kwargs.alpha = 1.51
        c.env.params.median_turns = 1.5
    else:
        c = {"guess_number": grpo_guess_number, "countdown": grpo_countdown}[name].get_config()
        c.warm_start.sft_steps = 0
        c.loss.sft_coef = 0.0
    c.rollout.num_tasks, c.rollout.group_size = (2, 2) if tiny else (8, 4)
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 64, 2, 128
    c.model.num_heads = c.model.num_kv_heads = 2
    c.updates.minibatches = 1
    return c


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", default="0.25",
                        help="comma-separated slot counts as fractions of num_tasks * "
                             "group_size, one arm each")
    parser.add_argument("--service-batch", type=float, default=0.25,
                        help="rollout.slot_service_batch as a fraction of the slots")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--tiny", action="store_true", help="smallest sizes (a script check)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--rollout-only", action="store_true",
                        help="time the rollout alone, with iterations and ms / iteration")
    args = parser.parse_args(argv)
    if args.rollout_only:
        return rollout_only(args)

    from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel
    from arl.rollout import slots as slots_lib  # pylint: disable=import-outside-toplevel

    load_before = common.load_average()
    rows, notes = [], []
    for workload in args.workloads.split(","):
        base = workload_config(workload, args.tiny)
        batch = base.rollout.num_tasks * base.rollout.group_size
        slot_counts = [max(1, round(float(f) * batch)) for f in args.slots.split(",")]
        arms = {}
        for arm in ["lockstep"] + [f"slots ({n} rows)" for n in slot_counts]:
            c = workload_config(workload, args.tiny)
            if arm != "lockstep":
                num_slots = slot_counts[len(arms) - 1]
                c.rollout.schedule = "slots"
                c.rollout.num_slots = num_slots
                c.rollout.slot_service_batch = max(1, round(args.service_batch * num_slots))
            trainer = TokenTrainer(c)
            arms[arm] = {"trainer": trainer, "state": trainer.init_state(), "tokens": []}

        def run(arm):
            entry = arms[arm]
            state = entry["state"]
            for _ in range(args.steps):
                state, metrics = entry["trainer"].train_step(state)
                entry["tokens"].append(metrics["response_tokens_mean"])
            jax.block_until_ready(state)
            entry["state"] = state

        compile_s = {}
        for arm in arms:  # compile and warm up
            start = time.perf_counter()
            run(arm)
            compile_s[arm] = time.perf_counter() - start
        times = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm in arms:
                start = time.perf_counter()
                run(arm)
                times[arm].append((time.perf_counter() - start) / args.steps)

        # The workload's episodes and the slots' busy share, from one rollout each.
        first_slots = f"slots ({slot_counts[0]} rows)"
        trainer = arms[first_slots]["trainer"]
        c = trainer.config
        num_slots = c.rollout.num_slots
        state = arms[first_slots]["state"]
        policy = trainer.policy_params(state)
        key = jax.random.key(7)
        traj, stats = jax.jit(lambda p, k: slots_lib.slot_rollout(
            trainer.env, k, num_tasks=c.rollout.num_tasks, group_size=c.rollout.group_size,
            model=trainer.model, params=p, sampling=trainer.sampling,
            env_params=trainer.task_params(c.rollout.num_tasks, c.rollout.group_size),
            share_group_prefill=True, num_slots=num_slots,
            service_batch=c.rollout.slot_service_batch, return_stats=True))(policy, key)
        tokens = np.asarray(traj.agent_mask.sum(axis=1))
        busy = float(stats.busy_slot_steps) / max(1, num_slots * int(stats.decode_steps))
        lock_s = statistics.median(times["lockstep"])
        for arm in arms:
            step_s = statistics.median(times[arm])
            trained = float(np.mean([float(t) for t in arms[arm]["tokens"]])) * batch
            rows.append([workload, arm,
                         common.fmt_ms(step_s), common.fmt_rate(trained / step_s),
                         f"{batch / step_s:.1f}", f"{lock_s / step_s:.2f}x",
                         f"{compile_s[arm]:.0f}"])
        notes.append(f"{workload}: batch {batch} episodes, agent tokens per episode median "
                     f"{np.median(tokens):.0f}, p99 : median "
                     f"{np.percentile(tokens, 99) / max(1.0, np.median(tokens)):.1f}; "
                     f"{first_slots} busy {busy:.0%} of decode slot-steps, service batch "
                     f"{c.rollout.slot_service_batch}")
    description = (
        "GRPO steps (rollout + update), d_model 64, 2 layers, float32; slots vs lockstep "
        f"on the same episodes (same seed, nothing carried over). {args.steps} steps x "
        f"{args.rounds} interleaved rounds, median; load average {load_before:.1f} before, "
        f"{common.load_average():.1f} after. " + "; ".join(notes) + ". The first "
        "(compile + warm-up) call's seconds in the last column.")
    text = (common.heading("continuous_batching.py") + description + "\n\n"
            + common.markdown_table(["workload", "scheduler", "ms / step", "trained tok/s",
                                     "episodes/s", "speed-up", "first call s"], rows))
    common.publish("Continuous batching (slot scheduling)", text, write=not args.no_write)


def rollout_only(args):
    """The step's rollout alone per arm, interleaved rounds: ms per rollout, decode
    iterations and ms per iteration (the per-iteration cost is what slots trade against
    the iterations they save)."""
    from arl.trainers import TokenTrainer  # pylint: disable=import-outside-toplevel
    from arl.rollout import rollouts as rollouts_lib  # pylint: disable=import-outside-toplevel
    from arl.rollout import slots as slots_lib  # pylint: disable=import-outside-toplevel

    load_before = common.load_average()
    rows, notes = [], []
    key = jax.random.key(7)
    for workload in args.workloads.split(","):
        c = workload_config(workload, args.tiny)
        trainer = TokenTrainer(c)
        r = c.rollout
        batch = r.num_tasks * r.group_size
        env_params = trainer.task_params(r.num_tasks, r.group_size)
        policy = trainer.policy_params(trainer.init_state())
        env = trainer.env
        arms = {"lockstep": jax.jit(lambda p, k: (rollouts_lib.rollout(
            env, k, num_tasks=r.num_tasks, group_size=r.group_size, model=trainer.model,
            params=p, sampling=trainer.sampling, env_params=env_params,
            share_group_prefill=True), None))}
        for fraction in args.slots.split(","):
            n = max(1, round(float(fraction) * batch))
            service = max(1, round(args.service_batch * n))
            arms[f"slots ({n} rows)"] = jax.jit(
                lambda p, k, n=n, service=service: slots_lib.slot_rollout(
                    env, k, num_tasks=r.num_tasks, group_size=r.group_size,
                    model=trainer.model, params=p, sampling=trainer.sampling,
                    env_params=env_params, share_group_prefill=True, num_slots=n,
                    service_batch=service, return_stats=True))
        results = {arm: jax.block_until_ready(fn(policy, key)) for arm, fn in arms.items()}
        times = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm, fn in arms.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(policy, key))
                times[arm].append(time.perf_counter() - start)
        traj = results["lockstep"][0]
        tokens = np.asarray(traj.agent_mask.sum(axis=1))
        lock_s = statistics.median(times["lockstep"])
        for arm in arms:
            stats = results[arm][1]
            iterations = (env.max_turns * env.action_len if stats is None
                          else int(stats.iterations))
            seconds = statistics.median(times[arm])
            rows.append([workload, arm, common.fmt_ms(seconds), str(iterations),
                         f"{seconds / iterations * 1e3:.2f}",
                         common.fmt_rate(float(tokens.sum()) / seconds),
                         f"{batch / seconds:.1f}", f"{lock_s / seconds:.2f}x"])
        notes.append(f"{workload}: batch {batch}, agent tokens per episode median "
                     f"{np.median(tokens):.0f}, max {int(tokens.max())} (the longest episode "
                     f"bounds every arm's iterations without partial rollouts)")
    description = (
        f"The step's rollout alone, d_model 64, 2 layers, float32, {args.rounds} "
        f"interleaved rounds, median; load average {load_before:.1f} before, "
        f"{common.load_average():.1f} after. " + "; ".join(notes) + ".")
    text = (common.heading("continuous_batching.py") + description + "\n\n"
            + common.markdown_table(["workload", "scheduler", "ms / rollout",
                                     "decode iterations", "ms / iteration",
                                     "agent tok/s", "episodes/s", "speed-up"], rows))
    common.publish("Continuous batching: where the rollout's time goes", text,
                   write=not args.no_write)


if __name__ == "__main__":
    main()

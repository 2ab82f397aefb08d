"""Slot scheduling and partial rollouts against lockstep rollouts (`rollout.schedule`,
`rollout.carried_groups`, `arl.rollout.slots`): trained tokens and finished episodes per
second of whole GRPO steps (rollout + update).

    python benchmarks/continuous_batching.py [--steps 2] [--rounds 3] [--slots 0.25]
        [--staleness 1,2] [--carried 0.5] [--workloads long_tail,guess_number,countdown]
        [--tiny] [--no-write] [--rollout-only]

Workloads: `long_tail` (benchmarks/long_tail_env.py: each episode's number of turns drawn
from a Pareto tail whose p99 is 10x its median, capped at max_turns), `guess_number` and
`countdown` as shipped (configs/grpo_*.py, no warm start), each at the same tiny model.
Arms: lockstep; slots with each `--slots` fraction x (num_tasks * group_size)
generation rows; and partial rollouts on the first fraction's slots (with
`--rollout-only`: on every fraction's), one arm per `--staleness` value (rollout.max_staleness), with `--carried` x num_tasks groups (at
least 1) carried beyond each step's quota. Lockstep and plain slots play the same
episodes from the same keys (the same trained tokens); they differ in how the decoding is
scheduled. A partial arm's step returns the num_tasks groups that finished first, carried
ones begun in earlier steps included, so its episodes, and its trained tokens, differ
from step to step: its tokens/s counts the agent tokens of the episodes each step
returns (tokens decoded for episodes restarted at the staleness bound are never trained
and not counted). Every arm's loss applies the same off-policy correction
(loss.off_policy_correction="tis", which partial rollouts need; at lag 0 its weights are
1 up to rounding), so the update is the same computation in every arm. Each arm runs
`--steps` steps per round, round-robin over `--rounds` rounds; medians. The table also
gives each workload's episode tokens (median, p99 : median) and the slots' busy share
(decoding slot-steps / (slots x decode iterations)).

`--rollout-only` times the step's rollout alone (no update) and adds where its time goes:
decode iterations (lockstep: max_turns x action_len, its turns scan their whole budget;
slots: `SlotStats.iterations`) and milliseconds per iteration; its own section,
"Continuous batching: where the rollout's time goes". There call i of every arm draws
its fresh groups from the same key, so all arms sample one population of episodes (a
single fixed batch of a heavy-tailed workload can be far from its mean); a partial arm is
timed in steady state: each call continues the episodes the previous call carried, at
the next parameter version (the same parameters), after max(3, 1 + max_staleness)
warm-up calls.
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


def slot_counts(args, batch: int) -> list[int]:
    """The slot arms' generation rows, one per `--slots` fraction of the batch."""
    return [max(1, round(float(f) * batch)) for f in args.slots.split(",")]


def service_batch(args, num_slots: int) -> int:
    return max(1, round(args.service_batch * num_slots))


def carried_groups(args, num_tasks: int) -> int:
    return max(1, round(args.carried * num_tasks))


def staleness_values(args) -> list[int]:
    return [int(s) for s in args.staleness.split(",")]


def slots_arm(num_slots: int) -> str:
    return f"slots ({num_slots} rows)"


def partial_arm(num_slots: int, staleness: int) -> str:
    return f"{slots_arm(num_slots)} + partial (staleness {staleness})"


def warm_up_calls(staleness: int | None) -> int:
    """Calls before an arm is timed: the first compiles and the next two may still pay
    one-time costs (2-core CPU, tiny long_tail GRPO steps, no recompilation or full
    garbage collection between them: lockstep 64 s, 0.2 s, then ~20 ms; partial rollouts
    at staleness 1 25 s, 12 ms, 0.2 s, then ~10 ms); a partial arm's carried groups reach
    their steady mix of ages after 1 + max_staleness calls (a group can be carried
    through max_staleness steps before it restarts)."""
    return max(3, 1 + (staleness or 0))


def arm_configs(workload: str, args) -> dict:
    """Each whole-step arm's config, by name (plus its max_staleness, None for
    lockstep and plain slots)."""

    def config(num_slots=0, staleness=None):
        c = workload_config(workload, args.tiny)
        # The same correction in every arm: partial rollouts need one, and the update
        # (its proximal log-probs included) then costs the same whichever arm runs it.
        c.loss.off_policy_correction = "tis"
        if num_slots:
            c.rollout.schedule = "slots"
            c.rollout.num_slots = num_slots
            c.rollout.slot_service_batch = service_batch(args, num_slots)
        if staleness is not None:
            c.rollout.carried_groups = carried_groups(args, c.rollout.num_tasks)
            c.rollout.max_staleness = staleness
        return c, staleness

    base = workload_config(workload, args.tiny)
    counts = slot_counts(args, base.rollout.num_tasks * base.rollout.group_size)
    arms = {"lockstep": config()}
    for n in counts:
        arms[slots_arm(n)] = config(n)
    for staleness in staleness_values(args):
        arms[partial_arm(counts[0], staleness)] = config(counts[0], staleness)
    return arms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", default="0.25",
                        help="comma-separated slot counts as fractions of num_tasks * "
                             "group_size, one arm each")
    parser.add_argument("--service-batch", type=float, default=0.25,
                        help="rollout.slot_service_batch as a fraction of the slots")
    parser.add_argument("--staleness", default="1,2",
                        help="comma-separated rollout.max_staleness values, one partial-"
                             "rollout arm each (on the first --slots fraction's slots)")
    parser.add_argument("--carried", type=float, default=0.5,
                        help="rollout.carried_groups as a fraction of num_tasks (at least 1)")
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
        first_slots = slots_arm(slot_counts(args, batch)[0])
        arms = {}
        for arm, (c, staleness) in arm_configs(workload, args).items():
            trainer = TokenTrainer(c)
            arms[arm] = {"trainer": trainer, "state": trainer.init_state(),
                         "staleness": staleness, "metrics": []}

        def run(arm, steps, record):
            entry = arms[arm]
            state = entry["state"]
            for _ in range(steps):
                state, metrics = entry["trainer"].train_step(state)
                if record:
                    entry["metrics"].append(metrics)
            jax.block_until_ready(state)
            entry["state"] = state

        compile_s = {}
        for arm, entry in arms.items():  # compile and warm up
            start = time.perf_counter()
            run(arm, args.steps, record=False)
            compile_s[arm] = time.perf_counter() - start
            # On, untimed, past the first steps' one-time costs and, for partial arms,
            # until their carried groups are in steady state.
            settle = warm_up_calls(entry["staleness"]) - args.steps
            run(arm, max(0, settle), record=False)
        times = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm in arms:
                start = time.perf_counter()
                run(arm, args.steps, record=True)
                times[arm].append((time.perf_counter() - start) / args.steps)

        # The workload's episodes and the slots' busy share, from one rollout each.
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

        def mean_metric(arm, name):
            return float(np.mean([float(m[name]) for m in arms[arm]["metrics"]]))

        # Trained tokens per step: the mean agent tokens of the episodes the timed steps
        # returned, x the batch (a partial arm's differ from step to step).
        trained = {arm: mean_metric(arm, "response_tokens_mean") * batch for arm in arms}
        rate = {arm: trained[arm] / statistics.median(times[arm]) for arm in arms}
        for arm in arms:
            step_s = statistics.median(times[arm])
            rows.append([workload, arm,
                         common.fmt_ms(step_s), common.fmt_rate(rate[arm]),
                         f"{batch / step_s:.1f}", f"{rate[arm] / rate['lockstep']:.2f}x",
                         f"{compile_s[arm]:.0f}"])
        partial = [f"{arm}: {mean_metric(arm, 'rollout/restarted_episodes'):.1f} episodes "
                   f"restarted per step, agent tokens "
                   f"{mean_metric(arm, 'off_policy/token_staleness_mean'):.2f} versions old "
                   f"on average" for arm in arms if arms[arm]["staleness"] is not None]
        notes.append(f"{workload}: batch {batch} episodes, agent tokens per episode median "
                     f"{np.median(tokens):.0f}, p99 : median "
                     f"{np.percentile(tokens, 99) / max(1.0, np.median(tokens)):.1f}; "
                     f"{first_slots} busy {busy:.0%} of decode slot-steps, service batch "
                     f"{c.rollout.slot_service_batch}; trained tokens per step: lockstep "
                     f"{trained['lockstep']:.0f}"
                     + "".join(f", {arm} {trained[arm]:.0f}" for arm in arms
                               if arms[arm]["staleness"] is not None)
                     + ("; " if partial else "") + "; ".join(partial))
    description = (
        "GRPO steps (rollout + update), d_model 64, 2 layers, float32. Lockstep and slots "
        "play the same episodes (same seed, nothing carried over); partial arms carry "
        f"{args.carried:g} x num_tasks groups (at least 1) beyond each step's quota on the "
        "first slot count, so the episodes a step returns, and its trained tokens, differ "
        "per step: trained tok/s = the mean agent tokens of the episodes the timed steps "
        "returned x batch / median step time, and the speed-up is that rate over "
        "lockstep's (episodes/s: batch / step time). Every arm's loss uses "
        "loss.off_policy_correction='tis' (at lag 0 its weights are 1 up to rounding), so "
        f"the update is the same computation in each. {args.steps} steps x {args.rounds} "
        f"interleaved rounds, median, after max({args.steps}, 3, 1 + max_staleness) "
        f"warm-up steps; load average {load_before:.1f} before, "
        f"{common.load_average():.1f} after. " + "; ".join(notes) + ". The first "
        f"(compile + warm-up, {args.steps} steps) call's seconds in the last column.")
    text = (common.heading("continuous_batching.py") + description + "\n\n"
            + common.markdown_table(["workload", "scheduler", "ms / step", "trained tok/s",
                                     "episodes/s", "speed-up", "first call s"], rows))
    common.publish("Continuous batching (slot scheduling)", text, write=not args.no_write)


class PartialRollouts:
    """A partial arm's rollout calls in steady state: each call continues the episodes
    the previous one carried, at the next parameter version (the same parameters: the
    version only decides which carried groups are stale), its fresh groups drawn from the
    key folded with that version."""

    def __init__(self, trainer, policy, key, *, num_slots, service, carried, staleness):
        from arl.rollout import partial_rollouts as partial_lib  # pylint: disable=import-outside-toplevel

        r = trainer.config.rollout
        env, model = trainer.env, trainer.model
        env_params = trainer.task_params(r.num_tasks, r.group_size)
        # The carried episodes (their slots' caches) donated, as the trainer's step
        # donates the state that holds them.
        self.rollout = jax.jit(lambda p, k, carried_episodes, version: (
            partial_lib.partial_slot_rollout(
                env, jax.random.fold_in(k, version), carried_episodes,
                num_tasks=r.num_tasks, group_size=r.group_size,
                model=model, params=p, num_slots=num_slots, version=version,
                max_staleness=staleness, sampling=trainer.sampling, env_params=env_params,
                service_batch=service)), donate_argnums=2)
        carry_key, self.key = jax.random.split(key)
        # Placed as the rollout returns it (replicated on the trainer's mesh, as the
        # trainer places it): a default placement would compile the rollout twice.
        replicated = jax.sharding.NamedSharding(trainer.mesh, jax.sharding.PartitionSpec())
        self.carried = jax.jit(lambda p, k: partial_lib.initial_carried(
            env, k, carried_groups=carried, group_size=r.group_size, model=model, params=p,
            num_slots=num_slots, env_params=trainer.task_params(carried, r.group_size)),
                               out_shardings=replicated)(policy, carry_key)
        self.policy, self.version = policy, 0

    def __call__(self):
        traj, self.carried, stats = self.rollout(self.policy, self.key, self.carried,
                                                 self.version)
        self.version += 1
        return traj, stats


class FreshRollouts:
    """A lockstep or slot arm's rollout calls: call i plays the episodes of
    `fold_in(key, i)` (the groups a partial arm's call i adds to its queue), so over the
    timed calls every arm draws from the same population of episodes, not one batch."""

    def __init__(self, fn, policy, key):
        _, self.key = jax.random.split(key)  # as PartialRollouts' fresh groups
        self.fn, self.policy, self.calls = fn, policy, 0

    def __call__(self):
        out = self.fn(self.policy, jax.random.fold_in(self.key, self.calls))
        self.calls += 1
        return out


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
        lockstep = jax.jit(lambda p, k: (rollouts_lib.rollout(
            env, k, num_tasks=r.num_tasks, group_size=r.group_size, model=trainer.model,
            params=p, sampling=trainer.sampling, env_params=env_params,
            share_group_prefill=True), None))
        # arm -> (a call returning (trajectory, stats or None), max_staleness or None)
        arms = {"lockstep": (FreshRollouts(lockstep, policy, key), None)}
        counts = slot_counts(args, batch)
        for n in counts:
            fn = jax.jit(lambda p, k, n=n: slots_lib.slot_rollout(
                env, k, num_tasks=r.num_tasks, group_size=r.group_size,
                model=trainer.model, params=p, sampling=trainer.sampling,
                env_params=env_params, share_group_prefill=True, num_slots=n,
                service_batch=service_batch(args, n),
                return_stats=True))
            arms[slots_arm(n)] = (FreshRollouts(fn, policy, key), None)
        groups = carried_groups(args, r.num_tasks)
        # Here on every slot count: with one slot per episode the longest episode bounds
        # a plain slot rollout's iterations, which is what carrying removes.
        for n in counts:
            for staleness in staleness_values(args):
                arms[partial_arm(n, staleness)] = (PartialRollouts(
                    trainer, policy, key, num_slots=n, service=service_batch(args, n),
                    carried=groups, staleness=staleness), staleness)
        for call, staleness in arms.values():  # compile; partial arms: to steady state
            for _ in range(warm_up_calls(staleness)):
                jax.block_until_ready(call())
        # Per timed call: seconds, agent tokens returned, decode iterations, restarts.
        calls = {arm: [] for arm in arms}
        last = {}
        for _ in range(args.rounds):
            for arm, (call, _) in arms.items():
                start = time.perf_counter()
                traj, stats = jax.block_until_ready(call())
                seconds = time.perf_counter() - start
                iterations = (env.max_turns * env.action_len if stats is None
                              else int(stats.iterations))
                restarted = 0 if stats is None else int(stats.restarted)
                calls[arm].append((seconds, int(traj.agent_mask.sum()), iterations,
                                   restarted))
                last[arm] = traj
        rates = {}
        for arm, (_, staleness) in arms.items():
            seconds, tokens, iterations, _ = (np.asarray(x, float) for x in zip(*calls[arm]))
            median_s = statistics.median(seconds)
            # Each call returns other episodes: totals over the timed calls.
            rates[arm] = tokens.sum() / seconds.sum()
            per_iteration = seconds.sum() / iterations.sum()
            rows.append([workload, arm, common.fmt_ms(median_s),
                         f"{statistics.median(iterations):.0f}",
                         f"{per_iteration * 1e3:.2f}", common.fmt_rate(rates[arm]),
                         f"{batch / median_s:.1f}",
                         f"{rates[arm] / rates['lockstep']:.2f}x"])
        tokens = np.asarray(last["lockstep"].agent_mask.sum(axis=1))
        drawn = np.mean([c[1] for c in calls["lockstep"]]) / batch
        partial = [f"{arm}: agent tokens per returned episode "
                   f"{np.mean([c[1] for c in calls[arm]]) / batch:.1f} on average, "
                   f"{np.mean([c[3] for c in calls[arm]]):.1f} episodes restarted per call"
                   for arm, (_, staleness) in arms.items() if staleness is not None]
        notes.append(f"{workload}: batch {batch}, agent tokens per episode {drawn:.1f} on "
                     f"average over lockstep's calls; in its last call median "
                     f"{np.median(tokens):.0f}, max {int(tokens.max())} (the longest episode "
                     f"bounds the iterations of every arm without partial rollouts); "
                     f"rollout.carried_groups {groups}"
                     + ("; " if partial else "") + "; ".join(partial))
    description = (
        f"The step's rollout alone, d_model 64, 2 layers, float32, {args.rounds} "
        "interleaved rounds. Call i of every arm draws its fresh groups from the same key "
        "(lockstep and slots play them; a partial arm adds them to its queue), so the arms "
        "sample one population of episodes, not one batch. A partial arm is timed in "
        "steady state: each call continues the episodes the previous one carried, at the "
        "next version (same parameters), after max(3, 1 + max_staleness) warm-up calls "
        "(other arms: 3). Agent tok/s = the agent tokens of the episodes the timed calls "
        "returned / their total seconds, ms / iteration = total seconds / total "
        "iterations, decode iterations: the median call's, episodes/s: batch / median "
        f"seconds. Speed-up: agent tok/s over lockstep's. Load average {load_before:.1f} before, "
        f"{common.load_average():.1f} after. " + "; ".join(notes) + ".")
    text = (common.heading("continuous_batching.py") + description + "\n\n"
            + common.markdown_table(["workload", "scheduler", "ms / rollout",
                                     "decode iterations", "ms / iteration",
                                     "agent tok/s", "episodes/s", "speed-up"], rows))
    common.publish("Continuous batching: where the rollout's time goes", text,
                   write=not args.no_write)


if __name__ == "__main__":
    main()

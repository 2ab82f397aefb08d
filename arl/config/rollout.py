"""`config.rollout`: tasks and samples per step, sampling, the horizon curriculum; and
how the batch divides over the mesh and the update's minibatches."""

from __future__ import annotations

import ml_collections

from arl import algorithm_table
from arl import algorithms as alg
from arl.config import history as history_section
from arl.config.checks import check_choice, check_range, fail

HISTORY_MODES = history_section.HISTORY_MODES  # docs/checkpoints.md, "History modes"


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.num_tasks = 16  # distinct tasks per step
    c.group_size = 8  # samples per task (GRPO group)
    c.temperature = 1.0
    c.top_k = 0
    c.top_p = 1.0
    # ScalingInter-RL horizon curriculum: h = rounds[min(step // every, len - 1)];
    # empty rounds means the environment's max_turns throughout.
    c.horizon_rounds = ()
    c.horizon_every = 100
    # Asynchronous rollouts (docs/async.md, checked in arl.config.off_policy): rollout t+1
    # runs while update t trains, on parameters policy_lag versions old (0 with an empty
    # mesh: the fused one-program step). mesh: () = on config.mesh's devices; else
    # (data, fsdp, tensor) over the next devices after the training mesh's.
    c.policy_lag = 0
    c.mesh = ()
    # Scheduling inside the rollout (docs/async.md, arl.rollout.slots): "lockstep" plays
    # a step's episodes side by side, turn by turn; "slots" plays them on num_slots
    # generation rows, each taking the next episode as soon as its own ends (0: one row
    # per episode, num_tasks * group_size). slot_service_batch: the env steps on the
    # waiting slots' turns once this many wait (or none is decoding).
    c.schedule = "lockstep"
    c.num_slots = 0
    c.slot_service_batch = 1
    # Partial rollouts (slots only): carried_groups groups play beyond the step's quota;
    # the step ends when num_tasks groups have finished and the others carry over,
    # unfinished, to the next step's newer parameters. max_staleness: a carried group
    # that started more versions ago than this restarts from its first turn.
    c.carried_groups = 0
    c.max_staleness = 1
    # How a multi-turn conversation becomes the policy's context, and the per-turn
    # history window (defaults and checks: arl.config.history).
    history_section.add_defaults(c)
    return c


SCHEDULES = ("lockstep", "slots")


def validate(config, algorithm: algorithm_table.Algorithm) -> None:
    r = config.rollout
    check_range(config, "rollout.num_tasks", 1, integer=True)
    check_range(config, "rollout.group_size", 1, integer=True)
    if r.group_size < algorithm.min_group_size:
        fail("rollout.group_size", r.group_size,
             f"algorithm {config.algorithm!r} compares samples within a group: need >= "
             f"{algorithm.min_group_size}")
    check_range(config, "rollout.temperature", 0.0)
    check_range(config, "rollout.top_k", 0, integer=True)
    check_range(config, "rollout.top_p", 0.0, 1.0, low_open=True)
    check_range(config, "rollout.horizon_every", 1, integer=True)
    _validate_schedule(config)
    history_section.validate(config, algorithm)
    if any(not isinstance(h, int) or h < 1 for h in r.horizon_rounds):
        fail("rollout.horizon_rounds", r.horizon_rounds, "expected positive integers")
    mesh = tuple(config.mesh)
    batch = r.num_tasks * r.group_size
    data_shards = mesh[0] * mesh[1]
    minibatches = config.updates.minibatches
    if batch % data_shards:
        fail("rollout.num_tasks", r.num_tasks,
             f"batch num_tasks*group_size={batch} must be divisible by the mesh's "
             f"data*fsdp={data_shards}")
    if batch % minibatches:
        fail("updates.minibatches", minibatches,
             f"must divide the batch num_tasks*group_size={batch}")
    if config.updates.shuffle == "groups" and r.num_tasks % minibatches:
        fail("updates.minibatches", minibatches,
             f"with updates.shuffle='groups' it must divide rollout.num_tasks={r.num_tasks} "
             f"(each minibatch holds whole groups)")
    if (batch // minibatches) % data_shards:
        fail("updates.minibatches", minibatches,
             f"minibatch size {batch // minibatches} must be divisible by "
             f"the mesh's data*fsdp={data_shards}")


def _validate_schedule(config) -> None:
    r = config.rollout
    check_choice(config, "rollout.schedule", SCHEDULES)
    batch = r.num_tasks * r.group_size
    check_range(config, "rollout.num_slots", 0, batch, integer=True)
    check_range(config, "rollout.slot_service_batch", 1, r.num_slots or batch, integer=True)
    check_range(config, "rollout.carried_groups", 0, integer=True)
    check_range(config, "rollout.max_staleness", 0, integer=True)
    if r.carried_groups and r.schedule != "slots":
        fail("rollout.carried_groups", r.carried_groups,
             f"partial rollouts run on slots (rollout.schedule='slots', not "
             f"{r.schedule!r}): allowed value is 0")
    if r.carried_groups and r.max_staleness and config.loss.off_policy_correction == "none":
        fail("loss.off_policy_correction", "none",
             f"rollout.carried_groups={r.carried_groups} continues episodes with parameters "
             f"up to rollout.max_staleness={r.max_staleness} updates newer than their first "
             f"tokens: choose one of {alg.CORRECTIONS[1:]} (or rollout.max_staleness=0)")
    if r.schedule != "slots":
        return
    if config.process.mc_samples > 0:
        fail("rollout.schedule", r.schedule,
             "Monte Carlo branching (process.mc_samples > 0) forks the turn states a "
             "lockstep rollout records: allowed values are ('lockstep',)")


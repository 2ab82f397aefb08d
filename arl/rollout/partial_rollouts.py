"""Partial rollouts: a slot rollout that ends at its quota and carries the rest over.

`partial_slot_rollout` plays `carried_groups` groups beyond the step's quota on the slot
loop of `arl.rollout.slots`. The loop ends as soon as `num_tasks` whole groups have
finished; what is unfinished (slots mid-turn with their caches, finished members of open
groups, episodes not started) is returned as `CarriedEpisodes` for the next step, which
continues it with its newer parameters. Each agent token records the parameter version
that sampled it (`Trajectory.token_versions`); a carried group that started more than
`max_staleness` versions before the step restarts from its first turn.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from arl.rollout.rollouts import (default_row_params, read_prompts, start_episodes,
                                  trajectory_of)
# The slot loop's own pieces: this module drives the same loop over a larger queue.
from arl.rollout.slots import (SlotRows, SlotStats, _check_sizes, _per_layer_if,
                               _Scheduler)
from arl.rollout.trajectory import SamplingConfig, Trajectory
from arl.rollout.turns import RolloutCarry, TurnRecord


@struct.dataclass
class CarriedEpisodes:
    """Partial rollouts: the groups a step leaves unfinished, carried into the next
    (`partial_slot_rollout`). E = `carried_groups` groups of G episodes, in the order
    they entered; `rows.episode` indexes them (free slots: -1). Caches are stacked."""

    rows: SlotRows  # [S]: the slots as the step left them, mid-turn ones included
    queue: RolloutCarry  # [E*G]: each episode before its first turn (no cache)
    episode_keys: jax.Array  # [E*G]
    env_params: Any  # [E*G]
    task_rows: jax.Array | None  # int32 [E*G]
    out: RolloutCarry  # [E*G]: finished episodes (no env state, no cache)
    out_records: TurnRecord  # [E*G, max_turns]
    out_versions: jax.Array  # int32 [E*G, T]
    started: jax.Array  # bool [E*G]
    finished: jax.Array  # bool [E*G]
    group_versions: jax.Array  # int32 [E]: the version the group (re)started at


def initial_carried(env, key: jax.Array, *, carried_groups: int, group_size: int, model,
                    params, num_slots: int, env_params: Any = None) -> CarriedEpisodes:
    """The `CarriedEpisodes` a run of partial rollouts starts from: `carried_groups`
    fresh groups (tasks and keys drawn from `key`, none started) and free slots.
    `env_params`: per-row params [carried_groups * group_size] (default: the env's)."""
    if carried_groups < 1:
        raise ValueError(f"carried_groups={carried_groups} must be >= 1")
    if env_params is None:
        env_params = default_row_params(env, carried_groups, group_size)
    start = start_episodes(env, key, num_tasks=carried_groups, group_size=group_size,
                           model=model, params=params, action_source="model",
                           env_params=env_params, reset_keys=None, share_group_prefill=True,
                           record_projections=False, prefill_prompts=False)
    queue = start.carry
    rows = carried_groups * group_size
    scheduler = _Scheduler(env, model, start.params, SamplingConfig(), None, num_slots, 1,
                           group_size, quota_groups=1, version=jnp.int32(0))
    prefilled = jax.eval_shape(lambda: read_prompts(env, model, start.params, queue,
                                                    group_size))
    zeros = lambda a: jnp.zeros(a.shape, a.dtype)
    template = queue.replace(cache=jax.tree.map(zeros, prefilled.cache),
                             last_logits=jnp.zeros(prefilled.last_logits.shape, jnp.float32),
                             values=jax.tree.map(zeros, prefilled.values))
    free = scheduler.free_rows(template)
    loop = scheduler.empty_loop(template, free)
    return CarriedEpisodes(
        rows=free.replace(episode=jnp.full((num_slots,), -1, jnp.int32)),
        queue=queue, episode_keys=start.episode_keys, env_params=env_params,
        task_rows=start.task_rows, out=loop.out, out_records=loop.out_records,
        out_versions=loop.out_versions, started=jnp.zeros((rows,), bool),
        finished=jnp.zeros((rows,), bool),
        group_versions=jnp.zeros((carried_groups,), jnp.int32))


def partial_slot_rollout(env, key: jax.Array, carried: CarriedEpisodes, *, num_tasks: int,
                         group_size: int, model, params, num_slots: int, version,
                         max_staleness: int, sampling: SamplingConfig = SamplingConfig(),
                         horizon: jax.Array | int | None = None, env_params: Any = None,
                         service_batch: int = 1
                         ) -> tuple[Trajectory, CarriedEpisodes, SlotStats]:
    """One step of partial rollouts: the carried groups and `num_tasks` fresh ones (drawn
    from `key`, per-row params `env_params`) are played on `num_slots` rows with the
    parameters of version `version` until `num_tasks` groups have finished; returns their
    `Trajectory` (the first finished groups in the order they entered, `token_versions`
    set), the groups left for the next step and the loop's stats.

    Before it plays, a carried group that started more than `max_staleness` versions ago
    is restarted from its first turn (its episodes counted in `SlotStats.restarted`), so
    every token of a returned episode was sampled by one of the versions
    `version - max_staleness .. version`. Every step reads the prompts afresh with the
    current parameters; an episode carried mid-turn goes on from its own cache, whose
    earlier positions the versions that wrote them computed.
    """
    carried_groups = carried.group_versions.shape[0]
    pool = (carried_groups + num_tasks) * group_size
    _check_sizes(model, params, num_slots, service_batch, pool)
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness} must be >= 0")
    if env_params is None:
        env_params = default_row_params(env, num_tasks, group_size)
    version = jnp.asarray(version, jnp.int32)
    fresh = start_episodes(env, key, num_tasks=num_tasks, group_size=group_size, model=model,
                           params=params, action_source="model", env_params=env_params,
                           reset_keys=None, share_group_prefill=True,
                           record_projections=False, prefill_prompts=False)
    params = fresh.params
    concat = lambda a, b: jax.tree.map(lambda x, y: jnp.concatenate([x, y]), a, b)
    unread = concat(carried.queue, fresh.carry)
    queue = read_prompts(env, model, params, unread, group_size)
    keys = jnp.concatenate([carried.episode_keys, fresh.episode_keys])
    pool_params = concat(carried.env_params, env_params)
    task_rows = (None if fresh.task_rows is None
                 else jnp.concatenate([carried.task_rows, fresh.task_rows]))

    scheduler = _Scheduler(env, model, params, sampling, horizon, num_slots, service_batch,
                           group_size, quota_groups=num_tasks, version=version)
    queue = scheduler.prepare(queue)
    # The staleness bound: groups that started too long ago play again from the start.
    group_of = jnp.arange(carried_groups * group_size) // group_size
    any_started = jnp.any(carried.started.reshape(carried_groups, group_size), axis=1)
    stale = any_started & (version - carried.group_versions > max_staleness)
    restart = stale[group_of]
    rows = carried.rows
    playing = rows.episode >= 0
    slot_restart = playing & restart[jnp.maximum(rows.episode, 0)]
    rows = rows.replace(
        slots=rows.slots.replace(cache=_per_layer_if(scheduler.per_layer, rows.slots.cache)),
        episode=jnp.where(playing & ~slot_restart, rows.episode, pool),
        decoding=rows.decoding & ~slot_restart, waiting=rows.waiting & ~slot_restart,
        emitted=jnp.where(slot_restart, 0, rows.emitted))
    group_versions = jnp.where(stale | ~any_started, version, carried.group_versions)
    empty = scheduler.empty_loop(queue, rows)
    pad = lambda old, new: jax.tree.map(
        lambda o, n: jnp.concatenate([o, n[o.shape[0]:]]), old, new)
    loop = empty.replace(
        out=pad(carried.out, empty.out), out_records=pad(carried.out_records,
                                                         empty.out_records),
        out_versions=pad(carried.out_versions, empty.out_versions),
        started=pad(carried.started & ~restart, empty.started),
        finished=pad(carried.finished & ~restart, empty.finished))
    loop = loop.replace(stats=loop.stats.replace(
        restarted=jnp.sum(carried.started & restart, dtype=jnp.int32)))
    loop = scheduler.run(queue, keys, pool_params, loop)

    # The first num_tasks finished groups leave; the others are carried, in order.
    groups = carried_groups + num_tasks
    complete = jnp.all(loop.finished.reshape(groups, group_size), axis=1)
    chosen = complete & (jnp.cumsum(complete) <= num_tasks)
    leaving = jnp.nonzero(chosen, size=num_tasks)[0]
    staying = jnp.nonzero(~chosen, size=carried_groups)[0]
    members = jnp.arange(group_size)
    rows_of = lambda g: (g[:, None] * group_size + members[None, :]).reshape(-1)
    out_rows, kept_rows = rows_of(leaving), rows_of(staying)
    take = lambda tree, idx: jax.tree.map(lambda x: jnp.take(x, idx, axis=0), tree)
    out = take(loop.out, out_rows)
    traj = trajectory_of(env, out.replace(cache=None), take(loop.out_records, out_rows),
                         num_tasks, group_size, False,
                         None if task_rows is None else task_rows[out_rows])
    traj = traj.replace(token_versions=loop.out_versions[out_rows])

    # Slots' episodes renumbered in the carried order.
    rank = jnp.zeros((groups,), jnp.int32).at[staying].set(
        jnp.arange(carried_groups, dtype=jnp.int32))
    pool_rows = jnp.arange(pool)
    renumbered = jnp.where(~chosen[pool_rows // group_size],
                           rank[pool_rows // group_size] * group_size + pool_rows % group_size,
                           -1)
    rows = loop.rows
    rows = rows.replace(
        episode=jnp.where(rows.episode < pool, renumbered[jnp.minimum(rows.episode, pool - 1)],
                          -1),
        slots=rows.slots.replace(cache=rows.slots.cache.stacked()))
    fresh_group_versions = jnp.full((num_tasks,), version)
    all_group_versions = jnp.concatenate([group_versions, fresh_group_versions])
    next_carried = CarriedEpisodes(
        rows=rows, queue=take(unread, kept_rows),
        episode_keys=keys[kept_rows], env_params=take(pool_params, kept_rows),
        task_rows=None if task_rows is None else task_rows[kept_rows],
        out=take(loop.out, kept_rows), out_records=take(loop.out_records, kept_rows),
        out_versions=loop.out_versions[kept_rows], started=loop.started[kept_rows],
        finished=loop.finished[kept_rows], group_versions=all_group_versions[staying])
    stats = loop.stats.replace(
        carried=jnp.sum(~next_carried.finished, dtype=jnp.int32))
    return traj, next_carried, stats


def partial_metrics(traj: Trajectory, stats: SlotStats, version) -> dict[str, jax.Array]:
    """What partial rollouts did in a step: episodes restarted at the staleness bound and
    carried unfinished (`rollout/...`), and how many versions old the trajectory's agent
    tokens are (`off_policy/token_staleness_{mean,max}`)."""
    agent = traj.agent_mask > 0
    age = jnp.where(agent, version - traj.token_versions, 0).astype(jnp.float32)
    return {
        "rollout/restarted_episodes": stats.restarted.astype(jnp.float32),
        "rollout/carried_episodes": stats.carried.astype(jnp.float32),
        "off_policy/token_staleness_mean": jnp.sum(age) / jnp.maximum(jnp.sum(agent), 1),
        "off_policy/token_staleness_max": jnp.max(age),
    }

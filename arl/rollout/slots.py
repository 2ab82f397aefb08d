"""Slot scheduling: a rollout that advances one decoded token at a time, not one turn.

A lockstep rollout (`arl.rollout.rollout`) plays all its episodes side by side: every
turn decodes until its longest row is done, and the step lasts as long as its longest
episode. Agent episodes are long-tailed, so most decode steps carry rows that have
already finished. Here a fixed number of generation rows, the slots, each play one
episode at a time, each in its own phase:

    decoding   the slot samples its turn's next token (all decoding slots in one call);
    waiting    its turn is written (a stop id or the action budget); the env steps on it
               and the reply is prefilled, for every waiting slot at once;
    free       its episode ended (done, or the horizon) and was copied out; the slot takes
               the next episode of the step's queue: its reset state and prompt cache.

All of it is one `lax.while_loop` inside the compiled step, one iteration per decoded
token; `slot_rollout` ends when every episode of the step has finished. Episodes draw
their randomness from their own keys (`arl.rollout.episode_keys`), so with the same key
the episodes are the ones `rollout` plays: the same tasks, tokens, rewards and turns; the
behaviour log-probs too, bit for bit where the slots' batch computes a row as lockstep's
does (the same number of rows, `num_slots = num_tasks * group_size`) and to float
rounding otherwise. The output is the same `Trajectory` (row i = episode i).

Waiting slots are served together: the env step and the reply prefill run when at least
`service_batch` slots wait, or no slot is decoding, so one [num_slots, reply] prefill
serves many turns.

Partial rollouts (`partial_slot_rollout`) remove the wait for the longest episode: the
queue holds `carried_groups` groups beyond the step's quota, the loop ends as soon as
`num_tasks` whole groups have finished, and what is unfinished (slots mid-turn with their
caches, finished members of open groups, episodes not started) is returned as
`CarriedEpisodes` for the next step, which continues it with its newer parameters. Each
agent token records the parameter version that sampled it (`Trajectory.token_versions`);
a carried group that started more than `max_staleness` versions before the step restarts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from arl.envs.base import TokenChunk
from arl.models import sampling as sampling_lib
from arl.models import transformer as transformer_lib
from arl.rollout import episode_keys as episode_keys_lib
from arl.rollout.rollouts import (default_row_params, read_prompts, start_episodes,
                                  trajectory_of)
from arl.rollout.trajectory import SamplingConfig, Trajectory
from arl.rollout.turns import RolloutCarry, TurnPlayer, TurnRecord, select_rows, write_rows
from arl.text import codec as codec_lib


@struct.dataclass
class SlotStats:
    """What a slot rollout did: loop iterations, iterations that decoded, the slot-steps
    of those that carried a decoding slot, env services (env step + reply prefill); with
    partial rollouts also the episodes restarted at the staleness bound and the episodes
    carried to the next step unfinished (running or not started)."""

    iterations: jax.Array
    decode_steps: jax.Array
    busy_slot_steps: jax.Array
    services: jax.Array
    restarted: jax.Array
    carried: jax.Array


@struct.dataclass
class SlotRows:
    """The generation rows: each slot's episode so far (with its cache) and the turn it
    is writing."""

    slots: RolloutCarry  # [S]
    episode: jax.Array  # int32 [S]: the episode a slot plays (free: out of range)
    decoding: jax.Array  # bool [S]
    waiting: jax.Array  # bool [S]: its turn is written, the env has not stepped yet
    emitted: jax.Array  # int32 [S]: tokens of the current turn
    action_tokens: jax.Array  # int32 [S, A]
    action_logp: jax.Array  # float32 [S, A]
    action_values: jax.Array | None  # float32 [S, A]
    records: TurnRecord  # [S, max_turns]
    # Partial rollouts only: the parameter version that sampled each token of the turn
    # being written, and of each context token (agent tokens; 0 elsewhere).
    action_versions: jax.Array | None = None  # int32 [S, A]
    token_versions: jax.Array | None = None  # int32 [S, T]


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


@struct.dataclass
class _Loop:
    rows: SlotRows
    out: RolloutCarry  # [Q]: finished episodes (no env state, no cache)
    out_records: TurnRecord  # [Q, max_turns]
    out_versions: jax.Array | None  # int32 [Q, T]
    started: jax.Array  # bool [Q]
    finished: jax.Array  # bool [Q]
    stats: SlotStats


def _map_cache(fn, *caches):
    """`fn(axis, *leaves)` over the batched leaves of `KVCache`s of one form (stacked:
    keys and values [L, B, ...]; per layer: tuples of [B, ...]; length [B])."""
    first = caches[0]
    if first.is_per_layer:
        keys = tuple(fn(0, *xs) for xs in zip(*(c.keys for c in caches)))
        values = tuple(fn(0, *xs) for xs in zip(*(c.values for c in caches)))
    else:
        keys = fn(1, *(c.keys for c in caches))
        values = fn(1, *(c.values for c in caches))
    return first.replace(keys=keys, values=values,
                         length=fn(0, *(c.length for c in caches)))


def _take(carry: RolloutCarry, rows) -> RolloutCarry:
    """Rows `rows` of a batched carry, its cache included."""
    take = lambda x, axis=0: jnp.take(x, rows, axis=axis)
    cache = None if carry.cache is None else _map_cache(lambda a, x: take(x, a), carry.cache)
    return jax.tree.map(take, carry.replace(cache=None)).replace(cache=cache)


def _select(pred, on_true: RolloutCarry, on_false: RolloutCarry) -> RolloutCarry:
    """Per-row select between two batched carries, their caches included."""

    def pick(axis, a, b):
        shape = [1] * a.ndim
        shape[axis] = pred.shape[0]
        return jnp.where(pred.reshape(shape), a, b)

    cache = None
    if on_true.cache is not None:
        cache = _map_cache(pick, on_true.cache, on_false.cache)
    rest = select_rows(pred, on_true.replace(cache=None), on_false.replace(cache=None))
    return rest.replace(cache=cache)


def _finished_rows(carry: RolloutCarry) -> RolloutCarry:
    """What a finished episode keeps: the context and tallies, not its state or cache."""
    return carry.replace(env_state=None, cache=None, last_logits=None)


def _scatter(buffer, rows, values):
    """buffer[rows[i]] = values[i] for every leaf; rows out of range are dropped."""
    return jax.tree.map(lambda b, v: b.at[rows].set(v, mode="drop"), buffer, values)


def _check_sizes(model, params, num_slots: int, service_batch: int, batch: int):
    if model is None or params is None:
        raise ValueError("slot rollouts sample from the policy: they need `model` and "
                         "`params`.")
    if not 1 <= num_slots <= batch:
        raise ValueError(f"num_slots={num_slots} must be in [1, num_tasks * group_size = "
                         f"{batch}]")
    if not 1 <= service_batch <= num_slots:
        raise ValueError(f"service_batch={service_batch} must be in [1, num_slots={num_slots}]")


def slot_rollout(env, key: jax.Array, *, num_tasks: int, group_size: int, model, params,
                 num_slots: int, sampling: SamplingConfig = SamplingConfig(),
                 horizon: jax.Array | int | None = None, env_params: Any = None,
                 share_group_prefill: bool | None = None, service_batch: int = 1,
                 return_stats: bool = False) -> Trajectory | tuple[Trajectory, SlotStats]:
    """Plays `num_tasks * group_size` episodes of `env` on `num_slots` generation rows and
    returns their `Trajectory` (row i = episode i, as `rollout` returns it); with
    `return_stats`, also the loop's `SlotStats`.

    Args (the others as `rollout`'s, with the policy sampling and each group's prompt
    prefilled once):
      num_slots: generation rows, 1 <= num_slots <= num_tasks * group_size.
      service_batch: the env steps on the waiting slots' turns (and their replies are
        prefilled) once at least this many wait, or when no slot is decoding.
    """
    batch = num_tasks * group_size
    _check_sizes(model, params, num_slots, service_batch, batch)
    if share_group_prefill is None:
        share_group_prefill = env_params is None
    if env_params is None:
        env_params = default_row_params(env, num_tasks, group_size)
    start = start_episodes(env, key, num_tasks=num_tasks, group_size=group_size, model=model,
                           params=params, action_source="model", env_params=env_params,
                           reset_keys=None, share_group_prefill=share_group_prefill,
                           record_projections=False)
    scheduler = _Scheduler(env, model, start.params, sampling, horizon, num_slots,
                           service_batch, group_size, quota_groups=num_tasks, version=None)
    queue = scheduler.prepare(start.carry)
    loop = scheduler.run(queue, start.episode_keys, env_params,
                         scheduler.empty_loop(queue, scheduler.free_rows(queue)))
    traj = trajectory_of(env, loop.out.replace(cache=None), loop.out_records, num_tasks,
                         group_size, False, start.task_rows)
    return (traj, loop.stats) if return_stats else traj


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


def _per_layer_if(per_layer: bool, cache):
    return cache.per_layer() if per_layer else cache


@dataclasses.dataclass(frozen=True)
class _Scheduler:
    """The slot loop over a queue of Q episodes (`run`): one `lax.while_loop`, one
    iteration per decoded token, until `quota_groups` groups of `group_size` have
    finished. `version` (int32 [] or None): the parameter version recorded per token
    (partial rollouts); None records none."""

    env: Any
    model: Any
    params: Any  # embedding gathered (`start_episodes`)
    sampling: SamplingConfig
    horizon: Any
    num_slots: int
    service_batch: int
    group_size: int
    quota_groups: int
    version: Any

    @property
    def per_layer(self) -> bool:
        return transformer_lib.decodes_per_layer(self.model.config)

    def prepare(self, queue: RolloutCarry) -> RolloutCarry:
        """The queue as the loop reads it: float32 logits, the cache per layer where the
        model decodes that way."""
        queue = queue.replace(last_logits=queue.last_logits.astype(jnp.float32))
        return queue.replace(cache=_per_layer_if(self.per_layer, queue.cache))

    def empty_records(self, rows: int) -> TurnRecord:
        max_turns = self.env.max_turns
        return TurnRecord(reward=jnp.zeros((rows, max_turns), jnp.float32),
                          process_reward=jnp.zeros((rows, max_turns), jnp.float32),
                          start=jnp.zeros((rows, max_turns), jnp.int32),
                          active=jnp.zeros((rows, max_turns), bool),
                          success=jnp.zeros((rows, max_turns), bool))

    def free_rows(self, queue: RolloutCarry) -> SlotRows:
        """Slots that play nothing yet (their carry: copies of the first queue rows)."""
        num_slots, action_len = self.num_slots, self.env.action_len
        batch = queue.tokens.shape[0]
        pad_id = jnp.int32(self.env.codec.pad_id)
        tracks = self.version is not None
        return SlotRows(
            slots=_take(queue, jnp.arange(num_slots) % batch),
            episode=jnp.full((num_slots,), batch, jnp.int32),
            decoding=jnp.zeros((num_slots,), bool),
            waiting=jnp.zeros((num_slots,), bool),
            emitted=jnp.zeros((num_slots,), jnp.int32),
            action_tokens=jnp.full((num_slots, action_len), pad_id),
            action_logp=jnp.zeros((num_slots, action_len), jnp.float32),
            action_values=(jnp.zeros((num_slots, action_len), jnp.float32)
                           if queue.values is not None else None),
            records=self.empty_records(num_slots),
            action_versions=(jnp.zeros((num_slots, action_len), jnp.int32) if tracks
                             else None),
            token_versions=(jnp.zeros((num_slots, queue.tokens.shape[1]), jnp.int32)
                            if tracks else None))

    def empty_loop(self, queue: RolloutCarry, rows: SlotRows) -> _Loop:
        batch, width = queue.tokens.shape
        zero = jnp.int32(0)
        return _Loop(
            rows=rows, out=_finished_rows(queue), out_records=self.empty_records(batch),
            out_versions=(jnp.zeros((batch, width), jnp.int32) if self.version is not None
                          else None),
            started=jnp.zeros((batch,), bool), finished=jnp.zeros((batch,), bool),
            stats=SlotStats(iterations=zero, decode_steps=zero, busy_slot_steps=zero,
                            services=zero, restarted=zero, carried=zero))

    def run(self, queue: RolloutCarry, episode_keys, env_params, loop: _Loop) -> _Loop:
        """Plays the queue's episodes from `loop` until the quota of groups finished."""
        env, model, sampling = self.env, self.model, self.sampling
        params = self.params
        if self.per_layer:  # as `TurnPlayer.play` decodes: weights sliced once
            params = transformer_lib.per_layer_params(params)
        variables = {"params": params}
        batch = queue.tokens.shape[0]
        groups = batch // self.group_size
        horizon = jnp.asarray(env.max_turns if self.horizon is None else self.horizon,
                              jnp.int32)
        turn_limit = jnp.minimum(horizon, env.max_turns)
        codec = env.codec
        stop_ids = jnp.asarray(codec_lib.stop_ids(codec), jnp.int32)
        pad_id = jnp.int32(codec.pad_id)
        vocab = queue.last_logits.shape[1]
        action_len, max_turns = env.action_len, env.max_turns
        num_slots = self.num_slots
        none = jnp.int32(batch)  # the episode number of a free slot
        turn_columns = jnp.arange(max_turns)[None, :]
        version = self.version
        tracks = version is not None

        def keys_of(rows: SlotRows):
            return jnp.take(episode_keys, jnp.minimum(rows.episode, batch - 1), axis=0)

        def assign(loop: _Loop) -> _Loop:
            rows = loop.rows
            free = rows.episode == none
            rank = jnp.cumsum(free.astype(jnp.int32)) - 1
            # The queue's next episodes, in order: the first not started.
            waiting_episodes = jnp.nonzero(~loop.started, size=num_slots, fill_value=batch)[0]
            new_episode = waiting_episodes[jnp.clip(rank, 0, num_slots - 1)]
            take = free & (new_episode < batch)
            episode = jnp.where(take, new_episode, rows.episode)
            slots = _select(take, _take(queue, jnp.minimum(new_episode, batch - 1)), rows.slots)
            records = select_rows(take, self.empty_records(num_slots), rows.records)
            token_versions = rows.token_versions
            if tracks:
                token_versions = jnp.where(take[:, None], 0, token_versions)
            rows = rows.replace(
                slots=slots, episode=episode,
                decoding=jnp.where(take, turn_limit > 0, rows.decoding),
                waiting=rows.waiting & ~take, emitted=jnp.where(take, 0, rows.emitted),
                records=records, token_versions=token_versions)
            started = loop.started.at[jnp.where(take, new_episode, batch)].set(
                True, mode="drop")
            return loop.replace(rows=rows, started=started)

        def decode(loop: _Loop) -> _Loop:
            rows = loop.rows
            slots, decoding = rows.slots, rows.decoding
            action_keys, _ = episode_keys_lib.turn_keys(keys_of(rows), slots.num_turns)
            gumbel = (None if sampling.greedy
                      else sampling_lib.row_noise(action_keys, rows.emitted, vocab))
            token, logp = sampling_lib.sample_from_logits(
                None, slots.last_logits, temperature=sampling.temperature,
                top_k=sampling.top_k, top_p=sampling.top_p, greedy=sampling.greedy,
                gumbel=gumbel)
            token = jnp.where(decoding, token, pad_id)
            logp = jnp.where(decoding, logp, 0.0)
            out = model.apply(variables, token[:, None], slots.cache,
                              num_valid=decoding.astype(jnp.int32), method="decode")
            last_logits = jnp.where(decoding[:, None], out.logits[:, 0], slots.last_logits)
            count = decoding.astype(jnp.int32)
            write = lambda buffer, value: write_rows(buffer, value[:, None], rows.emitted,
                                                     count)
            action_values = rows.action_values
            if action_values is not None:
                action_values = write(action_values, jnp.where(decoding, out.values[:, 0],
                                                               0.0))
            action_versions = rows.action_versions
            if tracks:
                action_versions = write(action_versions,
                                        jnp.broadcast_to(version, (num_slots,)))
            emitted = rows.emitted + count
            stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1) | (emitted >= action_len)
            turn_done = decoding & stop
            stats = loop.stats
            rows = rows.replace(
                slots=slots.replace(cache=out.cache, last_logits=last_logits),
                decoding=decoding & ~stop, waiting=rows.waiting | turn_done,
                emitted=emitted, action_tokens=write(rows.action_tokens, token),
                action_logp=write(rows.action_logp, logp), action_values=action_values,
                action_versions=action_versions)
            return loop.replace(rows=rows, stats=stats.replace(
                decode_steps=stats.decode_steps + 1,
                busy_slot_steps=stats.busy_slot_steps + jnp.sum(count)))

        def serve(loop: _Loop) -> _Loop:
            rows = loop.rows
            slots, active = rows.slots, rows.waiting
            _, step_keys = episode_keys_lib.turn_keys(keys_of(rows), slots.num_turns)
            episode_rows = jnp.minimum(rows.episode, batch - 1)
            player = TurnPlayer(env, model, params, sampling, "model",
                                jax.tree.map(lambda x: jnp.take(x, episode_rows, axis=0),
                                             env_params),
                                horizon)
            action = TokenChunk(tokens=rows.action_tokens,
                                length=jnp.where(active, rows.emitted, 0))
            turn = slots.num_turns
            token_versions = rows.token_versions
            if tracks:
                token_versions = write_rows(token_versions, rows.action_versions,
                                            slots.offset, action.length)
            slots, record = player.respond(slots, active, action, rows.action_logp,
                                           rows.action_values, slots.cache,
                                           slots.last_logits, step_keys)
            at_turn = active[:, None] & (turn_columns == turn[:, None])
            records = jax.tree.map(lambda old, new: jnp.where(at_turn, new[:, None], old),
                                   rows.records, record.replace(state=None))
            more = active & ~slots.done & (slots.num_turns < turn_limit)
            cleared = lambda x, value: (None if x is None
                                        else jnp.where(active[:, None], value, x))
            stats = loop.stats
            rows = rows.replace(
                slots=slots, records=records, waiting=rows.waiting & ~active,
                decoding=rows.decoding | more, emitted=jnp.where(active, 0, rows.emitted),
                action_tokens=cleared(rows.action_tokens, pad_id),
                action_logp=cleared(rows.action_logp, 0.0),
                action_values=cleared(rows.action_values, 0.0),
                action_versions=cleared(rows.action_versions, 0),
                token_versions=token_versions)
            return loop.replace(rows=rows, stats=stats.replace(services=stats.services + 1))

        def finish(loop: _Loop) -> _Loop:
            rows = loop.rows
            slots = rows.slots
            done = (rows.episode < batch) & ~rows.decoding & ~rows.waiting
            # Turns an episode did not play hold its final offset and success, as
            # lockstep's scan records them for rows that stopped.
            unplayed = turn_columns >= slots.num_turns[:, None]
            records = rows.records.replace(
                start=jnp.where(unplayed, slots.offset[:, None], rows.records.start),
                success=jnp.where(unplayed, slots.success[:, None], rows.records.success))
            out_rows = jnp.where(done, rows.episode, none)
            out_versions = loop.out_versions
            if tracks:
                out_versions = _scatter(out_versions, out_rows, rows.token_versions)
            return loop.replace(
                rows=rows.replace(episode=jnp.where(done, none, rows.episode)),
                out=_scatter(loop.out, out_rows, _finished_rows(slots)),
                out_records=_scatter(loop.out_records, out_rows, records),
                out_versions=out_versions,
                finished=loop.finished.at[out_rows].set(True, mode="drop"))

        def when(pred, fn, loop):
            return jax.lax.cond(pred, fn, lambda x: x, loop)

        def body(loop: _Loop) -> _Loop:
            rows = loop.rows
            loop = when(jnp.any(rows.episode == none) & ~jnp.all(loop.started), assign, loop)
            loop = when(jnp.any(loop.rows.decoding), decode, loop)
            waiting = jnp.sum(loop.rows.waiting, dtype=jnp.int32)
            loop = when((waiting > 0) & ((waiting >= self.service_batch)
                                         | ~jnp.any(loop.rows.decoding)), serve, loop)
            rows = loop.rows
            busy = rows.episode < batch
            loop = when(jnp.any(busy & ~rows.decoding & ~rows.waiting), finish, loop)
            stats = loop.stats
            return loop.replace(stats=stats.replace(iterations=stats.iterations + 1))

        def unfinished(loop: _Loop):
            complete = jnp.all(loop.finished.reshape(groups, self.group_size), axis=1)
            return jnp.sum(complete, dtype=jnp.int32) < self.quota_groups

        return jax.lax.while_loop(unfinished, body, loop)

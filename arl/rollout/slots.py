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

Partial rollouts (`arl.rollout.partial_rollouts`) run the same loop over a larger queue
and end it at the step's quota, carrying the unfinished episodes into the next step.
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
from arl.rollout.rollouts import default_row_params, start_episodes, trajectory_of
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

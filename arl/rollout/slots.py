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
token; it ends when every episode of the step has finished. Episodes draw their
randomness from their own keys (`arl.rollout.episode_keys`), so with the same key the
episodes are the ones `rollout` plays: the same tasks, tokens, rewards and turns; the
behaviour log-probs too, bit for bit where the slots' batch computes a row as lockstep's
does (the same number of rows, `num_slots = num_tasks * group_size`) and to float
rounding otherwise. The output is the same `Trajectory` (row i = episode i).

Waiting slots are served together: the env step and the reply prefill run when at least
`service_batch` slots wait, or no slot is decoding, so one [num_slots, reply] prefill
serves many turns.
"""

from __future__ import annotations

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
    of those that carried a decoding slot, and env services (env step + reply prefill)."""

    iterations: jax.Array
    decode_steps: jax.Array
    busy_slot_steps: jax.Array
    services: jax.Array


@struct.dataclass
class _Loop:
    slots: RolloutCarry  # [S]: each slot's episode so far, with its cache
    episode: jax.Array  # int32 [S]: the episode a slot plays; Q when free
    decoding: jax.Array  # bool [S]
    waiting: jax.Array  # bool [S]: its turn is written, the env has not stepped yet
    emitted: jax.Array  # int32 [S]: tokens of the current turn
    action_tokens: jax.Array  # int32 [S, A]
    action_logp: jax.Array  # float32 [S, A]
    action_values: jax.Array | None  # float32 [S, A]
    records: TurnRecord  # [S, max_turns]
    out: RolloutCarry  # [Q]: finished episodes (no env state, no cache)
    out_records: TurnRecord  # [Q, max_turns]
    next_episode: jax.Array  # int32: the queue's head
    finished: jax.Array  # int32
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
    if model is None or params is None:
        raise ValueError("slot_rollout samples from the policy: it needs `model` and `params`.")
    if not 1 <= num_slots <= batch:
        raise ValueError(f"num_slots={num_slots} must be in [1, num_tasks * group_size = "
                         f"{batch}]")
    if not 1 <= service_batch <= num_slots:
        raise ValueError(f"service_batch={service_batch} must be in [1, num_slots={num_slots}]")
    if share_group_prefill is None:
        share_group_prefill = env_params is None
    if env_params is None:
        env_params = default_row_params(env, num_tasks, group_size)
    horizon = jnp.asarray(env.max_turns if horizon is None else horizon, jnp.int32)
    turn_limit = jnp.minimum(horizon, env.max_turns)
    start = start_episodes(env, key, num_tasks=num_tasks, group_size=group_size, model=model,
                           params=params, action_source="model", env_params=env_params,
                           reset_keys=None, share_group_prefill=share_group_prefill,
                           record_projections=False)
    queue, params = start.carry, start.params
    queue = queue.replace(last_logits=queue.last_logits.astype(jnp.float32))
    per_layer = transformer_lib.decodes_per_layer(model.config)
    if per_layer:  # as `TurnPlayer.play` decodes: one buffer per layer, weights sliced once
        params = transformer_lib.per_layer_params(params)
        queue = queue.replace(cache=queue.cache.per_layer())
    variables = {"params": params}

    action_len, max_turns = env.action_len, env.max_turns
    codec = env.codec
    stop_ids = jnp.asarray(codec_lib.stop_ids(codec), jnp.int32)
    pad_id = jnp.int32(codec.pad_id)
    vocab = queue.last_logits.shape[1]
    has_values = queue.values is not None
    none = jnp.int32(batch)  # the episode number of a free slot
    turn_columns = jnp.arange(max_turns)[None, :]

    def empty_records(rows):
        return TurnRecord(reward=jnp.zeros((rows, max_turns), jnp.float32),
                          process_reward=jnp.zeros((rows, max_turns), jnp.float32),
                          start=jnp.zeros((rows, max_turns), jnp.int32),
                          active=jnp.zeros((rows, max_turns), bool),
                          success=jnp.zeros((rows, max_turns), bool))

    def assign(loop: _Loop) -> _Loop:
        free = loop.episode == none
        rank = jnp.cumsum(free.astype(jnp.int32)) - 1
        new_episode = loop.next_episode + rank
        take = free & (new_episode < batch)
        episode = jnp.where(take, new_episode, loop.episode)
        slots = _select(take, _take(queue, jnp.minimum(new_episode, batch - 1)), loop.slots)
        records = select_rows(take, empty_records(num_slots), loop.records)
        return loop.replace(
            slots=slots, episode=episode,
            decoding=jnp.where(take, turn_limit > 0, loop.decoding),
            waiting=loop.waiting & ~take, emitted=jnp.where(take, 0, loop.emitted),
            records=records, next_episode=loop.next_episode + jnp.sum(take, dtype=jnp.int32))

    def decode(loop: _Loop) -> _Loop:
        slots, decoding = loop.slots, loop.decoding
        keys = loop_keys(loop)
        action_keys, _ = episode_keys_lib.turn_keys(keys, slots.num_turns)
        gumbel = (None if sampling.greedy
                  else sampling_lib.row_noise(action_keys, loop.emitted, vocab))
        token, logp = sampling_lib.sample_from_logits(
            None, slots.last_logits, temperature=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, greedy=sampling.greedy, gumbel=gumbel)
        token = jnp.where(decoding, token, pad_id)
        logp = jnp.where(decoding, logp, 0.0)
        out = model.apply(variables, token[:, None], slots.cache,
                          num_valid=decoding.astype(jnp.int32), method="decode")
        last_logits = jnp.where(decoding[:, None], out.logits[:, 0], slots.last_logits)
        count = decoding.astype(jnp.int32)
        action_tokens = write_rows(loop.action_tokens, token[:, None], loop.emitted, count)
        action_logp = write_rows(loop.action_logp, logp[:, None], loop.emitted, count)
        action_values = loop.action_values
        if has_values:
            value = jnp.where(decoding, out.values[:, 0], 0.0)
            action_values = write_rows(action_values, value[:, None], loop.emitted, count)
        emitted = loop.emitted + count
        stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1) | (emitted >= action_len)
        turn_done = decoding & stop
        stats = loop.stats
        return loop.replace(
            slots=slots.replace(cache=out.cache, last_logits=last_logits),
            decoding=decoding & ~stop, waiting=loop.waiting | turn_done, emitted=emitted,
            action_tokens=action_tokens, action_logp=action_logp,
            action_values=action_values,
            stats=stats.replace(decode_steps=stats.decode_steps + 1,
                                busy_slot_steps=stats.busy_slot_steps
                                + jnp.sum(count)))

    def loop_keys(loop: _Loop):
        return jnp.take(start.episode_keys, jnp.minimum(loop.episode, batch - 1), axis=0)

    def serve(loop: _Loop) -> _Loop:
        slots, active = loop.slots, loop.waiting
        _, step_keys = episode_keys_lib.turn_keys(loop_keys(loop), slots.num_turns)
        rows = jnp.minimum(loop.episode, batch - 1)
        player = TurnPlayer(env, model, params, sampling, "model",
                            jax.tree.map(lambda x: jnp.take(x, rows, axis=0), env_params),
                            horizon)
        action = TokenChunk(tokens=loop.action_tokens,
                            length=jnp.where(active, loop.emitted, 0))
        turn = slots.num_turns
        slots, record = player.respond(slots, active, action, loop.action_logp,
                                       loop.action_values, slots.cache, slots.last_logits,
                                       step_keys)
        at_turn = active[:, None] & (turn_columns == turn[:, None])
        records = jax.tree.map(lambda old, new: jnp.where(at_turn, new[:, None], old),
                               loop.records, record.replace(state=None))
        more = active & ~slots.done & (slots.num_turns < turn_limit)
        stats = loop.stats
        return loop.replace(
            slots=slots, records=records, waiting=loop.waiting & ~active,
            decoding=loop.decoding | more, emitted=jnp.where(active, 0, loop.emitted),
            action_tokens=jnp.where(active[:, None], pad_id, loop.action_tokens),
            action_logp=jnp.where(active[:, None], 0.0, loop.action_logp),
            action_values=(None if loop.action_values is None else
                           jnp.where(active[:, None], 0.0, loop.action_values)),
            stats=stats.replace(services=stats.services + 1))

    def finish(loop: _Loop) -> _Loop:
        slots = loop.slots
        done = (loop.episode < batch) & ~loop.decoding & ~loop.waiting
        # Turns an episode did not play hold its final offset and success, as lockstep's
        # scan records them for rows that stopped.
        unplayed = turn_columns >= slots.num_turns[:, None]
        records = loop.records.replace(
            start=jnp.where(unplayed, slots.offset[:, None], loop.records.start),
            success=jnp.where(unplayed, slots.success[:, None], loop.records.success))
        rows = jnp.where(done, loop.episode, none)
        return loop.replace(
            out=_scatter(loop.out, rows, _finished_rows(slots)),
            out_records=_scatter(loop.out_records, rows, records),
            episode=jnp.where(done, none, loop.episode),
            finished=loop.finished + jnp.sum(done, dtype=jnp.int32))

    def when(pred, fn, loop):
        return jax.lax.cond(pred, fn, lambda x: x, loop)

    def body(loop: _Loop) -> _Loop:
        loop = when(jnp.any(loop.episode == none) & (loop.next_episode < batch), assign, loop)
        loop = when(jnp.any(loop.decoding), decode, loop)
        waiting = jnp.sum(loop.waiting, dtype=jnp.int32)
        loop = when((waiting > 0) & ((waiting >= service_batch) | ~jnp.any(loop.decoding)),
                    serve, loop)
        busy = loop.episode < batch
        loop = when(jnp.any(busy & ~loop.decoding & ~loop.waiting), finish, loop)
        stats = loop.stats
        return loop.replace(stats=stats.replace(iterations=stats.iterations + 1))

    zero = jnp.int32(0)
    first_rows = jnp.arange(num_slots) % batch
    init = _Loop(
        slots=_take(queue, first_rows),
        episode=jnp.full((num_slots,), none),
        decoding=jnp.zeros((num_slots,), bool),
        waiting=jnp.zeros((num_slots,), bool),
        emitted=jnp.zeros((num_slots,), jnp.int32),
        action_tokens=jnp.full((num_slots, action_len), pad_id),
        action_logp=jnp.zeros((num_slots, action_len), jnp.float32),
        action_values=(jnp.zeros((num_slots, action_len), jnp.float32) if has_values
                       else None),
        records=empty_records(num_slots),
        out=_finished_rows(queue),
        out_records=empty_records(batch),
        next_episode=zero, finished=zero,
        stats=SlotStats(iterations=zero, decode_steps=zero, busy_slot_steps=zero,
                        services=zero))
    loop = jax.lax.while_loop(lambda loop: loop.finished < batch, body, init)
    out = loop.out.replace(cache=None)
    traj = trajectory_of(env, out, loop.out_records, num_tasks, group_size, False, start.task_rows)
    return (traj, loop.stats) if return_stats else traj

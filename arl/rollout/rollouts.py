"""The multi-turn rollout of a token environment, as one traceable function.

Turns are a `lax.scan` (`arl.rollout.turns.TurnPlayer`); inside a turn the policy decodes
with a KV cache (`arl.models.generate`), then the environment steps on the generated
chunk and its reply is prefilled into the cache. The result is a `Trajectory`
(`arl.rollout.trajectory`).

Keys: every episode draws from its own (`arl.rollout.episode_keys`: its group's reset key,
its episode key, turn and token numbers), so its play does not depend on the other rows;
`arl.rollout.slots` schedules the same episodes on fewer rows.

Groups: the `group_size` rows of a task share the reset key, so they see the same task
(environments sample the task in `reset` from its key) while their step keys differ.
Rows that start from the same observation also share its prefill: the model reads each
group's prompt once and the KV cache is copied to the group's rows (the rows diverge from
their first sampled token on).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from arl.envs.from_config import member_of_task, task_params
from arl.models import sampling as sampling_lib
from arl.models import transformer as transformer_lib
from arl.rollout import episode_keys as episode_keys_lib
from arl.rollout.trajectory import (SamplingConfig, Trajectory, chat_format,
                                     context_length, first_observation_length)
from arl.rollout.turns import ACTION_SOURCES, TurnPlayer, initial_carry, write_rows


def task_keys(key, num_tasks: int, group_size: int):
    """Reset keys `[num_tasks * group_size]`: the rows of a group share one key, group g's
    `fold_in(key, g)` (`arl.rollout.episode_keys`), whatever the number of groups."""
    return episode_keys_lib.group_reset_keys(key, num_tasks, group_size)


def default_row_params(env, num_tasks: int, group_size: int):
    """Default params for every row; a mixture gives task i to member i % num_envs."""
    return task_params(env, None, member_of_task(env, num_tasks, group_size))


def env_ids_of(timestep, batch: int) -> jax.Array:
    """int32 [batch]: each row's environment (mixture member) from a reset timestep."""
    env_id = timestep.info.get("env_id") if isinstance(timestep.info, dict) else None
    if env_id is None:
        return jnp.zeros((batch,), jnp.int32)
    return env_id.astype(jnp.int32)


def rollout(
    env,
    key: jax.Array,
    *,
    num_tasks: int,
    group_size: int,
    model: transformer_lib.Transformer | None = None,
    params: Any = None,
    sampling: SamplingConfig = SamplingConfig(),
    horizon: jax.Array | int | None = None,
    action_source: str = "model",
    env_params: Any = None,
    reset_keys: jax.Array | None = None,
    record_turn_states: bool = False,
    share_group_prefill: bool | None = None,
    record_projections: bool = False,
) -> Trajectory:
    """Plays `num_tasks * group_size` episodes of `env` and returns their trajectory.

    Args:
      env: a `TokenEnvironment` (single instance; batched here with vmap).
      key: PRNG key for tasks, sampling and environment transitions.
      num_tasks: distinct tasks; group_size: rows per task (same reset key).
      model, params: the policy, when `action_source == "model"`.
      sampling: temperature / top-k / top-p / greedy.
      horizon: maximum number of turns this step (data, so a curriculum can raise it
        without recompiling); rows still running after `horizon` turns are truncated.
      action_source: "model" samples from the policy; "oracle" / "demonstrator" use the
        environment's scripted policies (for SFT demonstrations and baselines).
      env_params: per-row environment params with a leading batch axis
        `[num_tasks * group_size]` (default: `default_row_params`).
      reset_keys: per-row reset keys `[num_tasks * group_size]` that fix the tasks (e.g.
        a stored evaluation set, `arl.rollout.episode_datasets`); default: drawn from `key`, shared by the
        rows of a group.
      record_turn_states: also return the environment state before every turn
        (`Trajectory.turn_states`), for Monte Carlo branching.
      share_group_prefill: prefill the first observation once per group and copy the
        KV cache (and values) to the group's rows, saving `group_size - 1` of every
        `group_size` prefills. Only valid when the rows of a group start from the same
        observation, which holds when they share reset key and env params (the default
        `reset_keys`, and per-task params such as `default_row_params` or the trainers'
        `task_params`); the result then equals the unshared one. None (default): on
        exactly when both `reset_keys` and `env_params` are left to their defaults.
      record_projections: keep every layer's projection outputs at every position the
        model read (`Trajectory.projections`, {name: [L, B, S, *features]}, zero where it
        read nothing), for an update at the same parameters to take as its forward
        values (`Transformer(..., projections=)`). Costs L x B x S x (the projections'
        widths) values in the activation dtype.
    """
    if action_source not in ACTION_SOURCES:
        raise ValueError(f"action_source={action_source!r}; allowed values are {ACTION_SOURCES}")
    if action_source == "model" and (model is None or params is None):
        raise ValueError("action_source='model' needs both `model` and `params`.")
    if record_projections and action_source != "model":
        raise ValueError(f"record_projections=True needs action_source='model' (the model's "
                         f"activations), got action_source={action_source!r}")
    if num_tasks < 1 or group_size < 1:
        raise ValueError(f"num_tasks={num_tasks} and group_size={group_size} must be >= 1.")
    if share_group_prefill is None:
        share_group_prefill = reset_keys is None and env_params is None
    if env_params is None:
        env_params = default_row_params(env, num_tasks, group_size)
    horizon = jnp.asarray(env.max_turns if horizon is None else horizon, jnp.int32)
    start = start_episodes(env, key, num_tasks=num_tasks, group_size=group_size, model=model,
                           params=params, action_source=action_source,
                           env_params=env_params, reset_keys=reset_keys,
                           share_group_prefill=share_group_prefill,
                           record_projections=record_projections)
    carry, params = start.carry, start.params
    player = TurnPlayer(env, model, params, sampling, action_source, env_params, horizon)
    carry, per_turn = player.play(carry, jnp.zeros((num_tasks * group_size,), jnp.int32),
                                  env.max_turns, start.episode_keys,
                                  record_states=record_turn_states)
    return trajectory_of(env, carry, per_turn, num_tasks, group_size, record_projections,
                         start.task_rows)


def trajectory_of(env, carry, per_turn, num_tasks: int, group_size: int,
                  record_projections: bool, task_rows) -> Trajectory:
    """The `Trajectory` of episodes of `env` played: their final `RolloutCarry` (row i =
    episode i) and per-turn `TurnRecord` [B, max_turns]."""
    return Trajectory(
        tokens=carry.tokens,
        agent_mask=carry.agent_mask,
        observation_mask=carry.observation_mask,
        behaviour_logp=carry.logp,
        rewards=carry.rewards,
        turn_end_mask=carry.turn_end,
        length=carry.offset,
        group_ids=jnp.repeat(jnp.arange(num_tasks, dtype=jnp.int32), group_size),
        env_ids=carry.env_ids,
        num_turns=carry.num_turns,
        success=carry.success,
        terminated=carry.terminated,
        episode_return=carry.episode_return,
        format_errors=carry.format_errors,
        values=carry.values,
        process_rewards=carry.process_rewards,
        turn_rewards=per_turn.reward,
        turn_starts=per_turn.start,
        turn_active=per_turn.active,
        turn_success=per_turn.success,
        turn_states=per_turn.state,
        projections=carry.cache.projections if record_projections else None,
        task_rows=task_rows,
        episode_stats=(jax.vmap(env.episode_stats)(carry.env_state)
                       if hasattr(env, "episode_stats") else None),
    )


@struct.dataclass
class EpisodeStarts:
    """Episodes before their first turn (`start_episodes`): the loop state with the
    prompts read, each episode's key (`arl.rollout.episode_keys`), the parameters as the
    loop reads them and the dataset rows of the tasks."""

    carry: Any
    episode_keys: jax.Array
    params: Any = None
    task_rows: jax.Array | None = None


def start_episodes(env, key, *, num_tasks: int, group_size: int, model, params,
                   action_source: str, env_params, reset_keys, share_group_prefill: bool,
                   record_projections: bool, prefill_prompts: bool = True) -> EpisodeStarts:
    """Resets `num_tasks * group_size` episodes and reads their prompts (the policy's
    prefill, once per group with `share_group_prefill`); the arguments as `rollout`'s.
    With `prefill_prompts=False` the prompts are written to the context but not read: no
    cache, logits or values yet (`read_prompts` reads them later)."""
    batch = num_tasks * group_size
    codec = env.codec
    width = context_length(env)

    reset_key, turns_key = jax.random.split(key)
    if reset_keys is None:
        reset_keys = task_keys(reset_key, num_tasks, group_size)
    elif reset_keys.shape != (batch,):
        raise ValueError(f"reset_keys must have shape ({batch},) (num_tasks * group_size), "
                         f"got {reset_keys.shape}")
    env_state, timestep = jax.vmap(env.reset)(reset_keys, env_params)
    task_rows = (jax.vmap(env.task_row)(env_state) if hasattr(env, "task_row") else None)

    tokens = jnp.full((batch, width), codec.pad_id, jnp.int32)
    prompt = timestep.observation
    chat = chat_format(env)
    if chat is None:  # arl's own codecs: <bos> + prompt
        tokens = tokens.at[:, 0].set(codec.bos_id)
        tokens = write_rows(tokens, prompt.tokens, jnp.ones((batch,), jnp.int32), prompt.length)
        offset = 1 + prompt.length
    else:  # the checkpoint's template: system block, user turn, generation prompt
        first_chunk = jax.vmap(chat.wrap_prompt)(prompt)
        tokens = write_rows(tokens, first_chunk.tokens, jnp.zeros((batch,), jnp.int32),
                            first_chunk.length)
        offset = first_chunk.length
    zeros = jnp.zeros((batch, width), jnp.float32)

    use_model = action_source == "model"
    record_values = use_model and model.config.value_head
    values = None
    if use_model:
        # One gathered table for every turn and decoded token, not one per loop level.
        params = transformer_lib.gather_embedding(params, model.config)
    if use_model and prefill_prompts:
        # Keys and values are computed in the activation dtype: a cache in that dtype
        # holds them exactly, at half the bytes of float32 for bfloat16 activations.
        if chat is None:
            first = jnp.concatenate(
                [jnp.full((batch, 1), codec.bos_id, jnp.int32), prompt.tokens], axis=1)
        else:
            first = first_chunk.tokens
        cache, last_logits, prompt_values = _prefill(
            model, params, first, offset, width, group_size if share_group_prefill else 1,
            record_projections)
        if record_values:
            values = write_rows(zeros, prompt_values, jnp.zeros((batch,), jnp.int32), offset)
    else:
        cache, last_logits = None, None

    carry = initial_carry(env_state, tokens, offset, env_ids_of(timestep, batch), cache,
                          last_logits, values, done=jnp.zeros((batch,), bool))
    return EpisodeStarts(carry=carry, params=params, task_rows=task_rows,
                         episode_keys=episode_keys_lib.episode_keys(turns_key, batch))


def read_prompts(env, model, params, carry, group_size: int):
    """`carry` (episodes before their first turn, `start_episodes(..., prefill_prompts=False)`)
    with its prompts read by the policy `params` (embedding gathered): the KV cache, the
    next token's logits and, with a value head, the prompt's values. The rows of each
    group of `group_size` start from the same observation; the model reads its first."""
    first = carry.tokens[:, :first_observation_length(env)]
    cache, last_logits, prompt_values = _prefill(
        model, params, first, carry.offset, carry.tokens.shape[1], group_size)
    values = None
    if model.config.value_head:
        values = write_rows(jnp.zeros(carry.tokens.shape, jnp.float32), prompt_values,
                            jnp.zeros_like(carry.offset), carry.offset)
    return carry.replace(cache=cache, last_logits=last_logits, values=values)


def _prefill(model, params, first, num_valid, capacity: int, group_size: int,
             record_projections: bool = False):
    """(KV cache, logits of the next token, values) after reading `first` [B, T] (row b's
    first `num_valid[b]` tokens) into an empty cache of `capacity` slots (recording the
    projections with `record_projections`). With `group_size` > 1 the B rows are B /
    group_size groups of identical rows: the model reads each group's first row only and
    its results are copied to the group."""
    batch = first.shape[0]
    rows = batch // group_size
    leaders = lambda x: x.reshape((rows, group_size) + x.shape[1:])[:, 0]
    cache = transformer_lib.init_cache(model.config, rows, capacity, model.config.dtype,
                                       record_projections=record_projections)
    out = model.apply({"params": params}, leaders(first), cache,
                      num_valid=leaders(num_valid), method="decode")
    last_logits = sampling_lib.take_last_valid(out.logits, leaders(num_valid))
    if group_size == 1:
        return out.cache, last_logits, out.values

    # Broadcast + reshape: jnp.repeat copies the same values but lowers to another
    # program, and the sharded golden run then rounds differently.
    def to_rows(x, axis=0):
        x = jnp.expand_dims(x, axis + 1)
        x = jnp.broadcast_to(x, x.shape[:axis + 1] + (group_size,) + x.shape[axis + 2:])
        return x.reshape(x.shape[:axis] + (batch,) + x.shape[axis + 2:])

    projections = out.cache.projections
    if projections is not None:
        projections = {name: to_rows(x, axis=1) for name, x in projections.items()}
    cache = out.cache.replace(keys=to_rows(out.cache.keys, axis=1),
                              values=to_rows(out.cache.values, axis=1),
                              length=to_rows(out.cache.length), projections=projections)
    values = None if out.values is None else to_rows(out.values)
    return cache, to_rows(last_logits), values


@functools.partial(jax.jit, static_argnames=("env", "num_tasks", "group_size", "action_source"))
def scripted_rollout(env, key, *, num_tasks, group_size, action_source="oracle"):
    """A jitted rollout of the environment's scripted policy (oracle / demonstrator)."""
    return rollout(env, key, num_tasks=num_tasks, group_size=group_size,
                   action_source=action_source)

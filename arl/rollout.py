"""Multi-turn rollout of a token environment, as one traceable function.

The context of every row is one left-aligned token buffer `[B, S]`:

    <bos> prompt | turn 1 (agent) | reply 1 (env) | turn 2 (agent) | reply 2 | ... <pad>

with `S = 1 + prompt_len + max_turns * (action_len + obs_len)`. Turns are a `lax.scan`;
inside a turn the policy decodes with a KV cache (`arl.models.generate`), then the
environment steps on the generated chunk and its reply is prefilled into the cache. Rows
differ in length, so every write goes to each row's own offset (scatter with
`mode="drop"`); nothing leaves the device.

Groups: the `group_size` rows of a task share the reset key, so they see the same task
(environments sample the task in `reset` from its key) while their step keys differ.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from arl.envs.base import TokenChunk
from arl.envs.wrappers import Mixture, broadcast_params
from arl.models import sampling as sampling_lib
from arl.models import transformer as transformer_lib

ACTION_SOURCES = ("model", "oracle", "demonstrator")


@struct.dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False


@struct.dataclass
class Trajectory:
    """A batch of multi-turn episodes in padded token buffers.

    Token-aligned arrays are `[B, S]`; a value at index t belongs to token t (its
    log-prob is log pi(token_t | tokens_<t)).
    """

    tokens: jax.Array  # int32 [B, S]
    agent_mask: jax.Array  # float32 [B, S]: 1 on tokens the policy wrote
    observation_mask: jax.Array  # float32 [B, S]: 1 on environment replies after the prompt
    behaviour_logp: jax.Array  # float32 [B, S]: log-prob under the sampling policy
    rewards: jax.Array  # float32 [B, S]: each turn's reward on its last agent token
    turn_end_mask: jax.Array  # float32 [B, S]: 1 on the last agent token of each turn
    length: jax.Array  # int32 [B]: valid tokens in the row
    group_ids: jax.Array  # int32 [B]: rows with the same id share a task
    env_ids: jax.Array  # int32 [B]: environment (mixture member) of the row
    num_turns: jax.Array  # int32 [B]
    success: jax.Array  # bool [B]
    terminated: jax.Array  # bool [B]
    episode_return: jax.Array  # float32 [B]: sum of turn rewards
    format_errors: jax.Array  # int32 [B]: malformed turns in the episode
    # float32 [B, S]: the value head's output at each position (value of the state after
    # token t), recorded while sampling; None when the policy has no value head.
    values: jax.Array | None = None
    # float32 [B, S]: each turn's process reward (progress, `info["process_reward"]`) on its
    # last agent token, kept apart from `rewards`; zero for envs that emit none.
    process_rewards: jax.Array | None = None
    # Per-turn arrays [B, max_turns]: the turn's reward, the context offset where its
    # agent tokens begin, whether it was played; and, with `record_turn_states`, the
    # environment state before the turn (a pytree with leading [B, max_turns] axes) from
    # which Monte Carlo branching (`arl.branching`) forks continuations.
    turn_rewards: jax.Array | None = None
    turn_starts: jax.Array | None = None
    turn_active: jax.Array | None = None
    turn_states: Any = None


def context_length(env) -> int:
    """The static length S of a rollout's token buffer for `env`."""
    return 1 + env.prompt_len + env.max_turns * (env.action_len + env.obs_len)


def _write_rows(buffer, chunk, offset, count):
    """buffer[b, offset[b] + i] = chunk[b, i] for i < count[b]; out-of-range dropped."""
    width = buffer.shape[1]
    idx = offset[:, None] + jnp.arange(chunk.shape[1])[None, :]
    idx = jnp.where(jnp.arange(chunk.shape[1])[None, :] < count[:, None], idx, width)
    return jax.vmap(lambda row, i, v: row.at[i].set(v, mode="drop"))(
        buffer, idx, chunk.astype(buffer.dtype))


def _select_tree(pred, on_true, on_false):
    """Per-row select between two batched pytrees (pred is bool [B])."""

    def pick(a, b):
        p = pred.reshape(pred.shape + (1,) * (a.ndim - 1))
        return jnp.where(p, a, b)

    return jax.tree.map(pick, on_true, on_false)


def task_keys(key, num_tasks: int, group_size: int):
    """Reset keys `[num_tasks * group_size]`: the rows of a group share one key."""
    keys = jax.random.split(key, num_tasks)
    return jnp.repeat(keys, group_size, axis=0)


def default_row_params(env, num_tasks: int, group_size: int):
    """Default params for every row; a mixture gives task i to member i % num_envs."""
    batch = num_tasks * group_size
    if isinstance(env, Mixture):
        member = jnp.arange(num_tasks, dtype=jnp.int32) % env.num_envs
        return env.batch_params(jnp.repeat(member, group_size))
    return broadcast_params(env.default_params(), batch)


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
        a stored evaluation set, `arl.datasets`); default: drawn from `key`, shared by
        the rows of a group.
      record_turn_states: also return the environment state before every turn
        (`Trajectory.turn_states`), for Monte Carlo branching.
    """
    if action_source not in ACTION_SOURCES:
        raise ValueError(f"action_source={action_source!r}; allowed values are {ACTION_SOURCES}")
    if action_source == "model" and (model is None or params is None):
        raise ValueError("action_source='model' needs both `model` and `params`.")
    if num_tasks < 1 or group_size < 1:
        raise ValueError(f"num_tasks={num_tasks} and group_size={group_size} must be >= 1.")
    batch = num_tasks * group_size
    if env_params is None:
        env_params = default_row_params(env, num_tasks, group_size)
    codec = env.codec
    width = context_length(env)
    max_turns = env.max_turns
    horizon = jnp.asarray(max_turns if horizon is None else horizon, jnp.int32)

    reset_key, turns_key = jax.random.split(key)
    if reset_keys is None:
        reset_keys = task_keys(reset_key, num_tasks, group_size)
    elif reset_keys.shape != (batch,):
        raise ValueError(f"reset_keys must have shape ({batch},) (num_tasks * group_size), "
                         f"got {reset_keys.shape}")
    env_state, timestep = jax.vmap(env.reset)(reset_keys, env_params)

    tokens = jnp.full((batch, width), codec.pad_id, jnp.int32)
    tokens = tokens.at[:, 0].set(codec.bos_id)
    prompt = timestep.observation
    tokens = _write_rows(tokens, prompt.tokens, jnp.ones((batch,), jnp.int32), prompt.length)
    offset = 1 + prompt.length
    zeros = jnp.zeros((batch, width), jnp.float32)

    use_model = action_source == "model"
    record_values = use_model and model.config.value_head
    values = None
    if use_model:
        cache = transformer_lib.init_cache(model.config, batch, width)
        first = jnp.concatenate(
            [jnp.full((batch, 1), codec.bos_id, jnp.int32), prompt.tokens], axis=1)
        out = model.apply({"params": params}, first, cache=cache, num_valid=offset)
        cache = out.cache
        last_logits = sampling_lib.take_last_valid(out.logits, offset)
        if record_values:
            values = _write_rows(zeros, out.values, jnp.zeros((batch,), jnp.int32), offset)
    else:
        cache, last_logits = None, None

    carry = initial_carry(env_state, tokens, offset, _env_ids(timestep, batch), cache,
                          last_logits, values, done=jnp.zeros((batch,), bool))
    player = TurnPlayer(env, model, params, sampling, action_source, env_params, horizon)
    carry, per_turn = player.play(carry, jnp.zeros((batch,), jnp.int32), max_turns, turns_key,
                                  record_states=record_turn_states)
    return Trajectory(
        tokens=carry["tokens"],
        agent_mask=carry["agent_mask"],
        observation_mask=carry["observation_mask"],
        behaviour_logp=carry["logp"],
        rewards=carry["rewards"],
        turn_end_mask=carry["turn_end"],
        length=carry["offset"],
        group_ids=jnp.repeat(jnp.arange(num_tasks, dtype=jnp.int32), group_size),
        env_ids=carry["env_ids"],
        num_turns=carry["num_turns"],
        success=carry["success"],
        terminated=carry["terminated"],
        episode_return=carry["episode_return"],
        format_errors=carry["format_errors"],
        values=carry["values"],
        process_rewards=carry["process_rewards"],
        turn_rewards=per_turn["reward"],
        turn_starts=per_turn["start"],
        turn_active=per_turn["active"],
        turn_states=per_turn.get("state"),
    )


def initial_carry(env_state, tokens, offset, env_ids, cache, last_logits, values, *, done):
    """The loop state of `TurnPlayer.play` before the first turn it plays: the context
    `tokens` holds `offset` valid tokens per row; rows with `done` set play nothing."""
    batch, width = tokens.shape
    zeros = jnp.zeros((batch, width), jnp.float32)
    return dict(
        env_state=env_state,
        tokens=tokens,
        agent_mask=zeros,
        observation_mask=zeros,
        logp=zeros,
        rewards=zeros,
        process_rewards=zeros,
        turn_end=zeros,
        offset=offset,
        done=done,
        success=jnp.zeros((batch,), bool),
        terminated=jnp.zeros((batch,), bool),
        num_turns=jnp.zeros((batch,), jnp.int32),
        episode_return=jnp.zeros((batch,), jnp.float32),
        format_errors=jnp.zeros((batch,), jnp.int32),
        env_ids=env_ids,
        cache=cache,
        last_logits=last_logits,
        values=values,
    )


@dataclasses.dataclass(frozen=True)
class TurnPlayer:
    """Plays turns of a batch of episodes: the policy writes a turn (KV-cached decoding or
    a scripted policy), the environment steps on it, its reply is appended to the
    context. Shared by `rollout` (from the first turn) and Monte Carlo branching
    (`arl.branching`, from a forked mid-episode state)."""

    env: Any
    model: Any
    params: Any
    sampling: SamplingConfig
    action_source: str
    env_params: Any
    horizon: jax.Array

    def play(self, carry, first_turn, num_turns: int, key, *, record_states: bool = False):
        """Runs `num_turns` turns (a `lax.scan`); row b's i-th turn is turn
        `first_turn[b] + i` of its episode, played while the row is not done and below
        the horizon. Returns the final carry and per-turn arrays `[B, num_turns]`:
        reward, process_reward, start (context offset where the turn begins), active,
        and with `record_states` the environment state before the turn."""
        def scan_turn(carry, xs):
            i, turn_key = xs
            return self._turn(carry, first_turn + i, turn_key, record_states)

        keys = jax.random.split(key, num_turns)
        carry, per_turn = jax.lax.scan(scan_turn, carry, (jnp.arange(num_turns), keys))
        return carry, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), per_turn)

    def _turn(self, carry, turn_index, key, record_states):
        env, model, params, sampling = self.env, self.model, self.params, self.sampling
        codec = env.codec
        batch, width = carry["tokens"].shape
        use_model = self.action_source == "model"
        record_values = carry["values"] is not None
        act_key, step_key = jax.random.split(key)
        active = (~carry["done"]) & (turn_index < self.horizon)
        if use_model:
            gen = sampling_lib.generate(
                model, params, carry["cache"], carry["last_logits"], act_key,
                max_new_tokens=env.action_len, eot_id=codec.eot_id, pad_id=codec.pad_id,
                active=active, temperature=sampling.temperature, top_k=sampling.top_k,
                top_p=sampling.top_p, greedy=sampling.greedy)
            action = TokenChunk(tokens=gen.tokens, length=gen.length)
            action_logp = gen.logp
            cache, last_logits = gen.cache, gen.last_logits
        else:
            policy = getattr(env, f"{self.action_source}_action")
            action = jax.vmap(policy)(
                jax.random.split(act_key, batch), carry["env_state"], self.env_params)
            action = TokenChunk(
                tokens=action.tokens, length=jnp.where(active, action.length, 0))
            action_logp = jnp.zeros(action.tokens.shape, jnp.float32)
            cache, last_logits = None, None

        new_state, ts = jax.vmap(env.step)(
            jax.random.split(step_key, batch), carry["env_state"], action, self.env_params)
        env_state = _select_tree(active, new_state, carry["env_state"])

        offset = carry["offset"]
        n_act = action.length
        ones = jnp.ones(action.tokens.shape, jnp.float32)
        tokens = _write_rows(carry["tokens"], action.tokens, offset, n_act)
        agent_mask = _write_rows(carry["agent_mask"], ones, offset, n_act)
        logp = _write_rows(carry["logp"], action_logp, offset, n_act)
        values = carry["values"]
        if record_values:
            values = _write_rows(values, gen.values, offset, n_act)
        info = ts.info
        reward = jnp.where(active, ts.reward, 0.0).astype(jnp.float32)
        process_reward = jnp.where(
            active, info.get("process_reward", jnp.zeros((batch,))), 0.0).astype(jnp.float32)
        has_turn = active & (n_act > 0)
        last = jnp.where(has_turn, offset + n_act - 1, width)
        rewards = _write_rows(carry["rewards"], reward[:, None], last, has_turn)
        process_rewards = _write_rows(carry["process_rewards"], process_reward[:, None], last,
                                      has_turn)
        turn_end = _write_rows(carry["turn_end"], jnp.ones((batch, 1)), last, has_turn)
        turn_start = offset
        offset = offset + n_act

        reply = ts.observation
        n_obs = jnp.where(active, reply.length, 0)
        tokens = _write_rows(tokens, reply.tokens, offset, n_obs)
        observation_mask = _write_rows(
            carry["observation_mask"], jnp.ones(reply.tokens.shape, jnp.float32), offset, n_obs)
        if use_model:
            out = model.apply({"params": params}, reply.tokens, cache=cache, num_valid=n_obs)
            cache = out.cache
            if record_values:
                values = _write_rows(values, out.values, offset, n_obs)
            last_logits = jnp.where(
                (n_obs > 0)[:, None], sampling_lib.take_last_valid(out.logits, n_obs),
                last_logits)
        offset = offset + n_obs

        new_carry = dict(
            env_state=env_state,
            tokens=tokens,
            agent_mask=agent_mask,
            observation_mask=observation_mask,
            logp=logp,
            rewards=rewards,
            process_rewards=process_rewards,
            turn_end=turn_end,
            offset=offset,
            done=carry["done"] | (active & ts.done),
            success=carry["success"] | (active & info["success"]),
            terminated=carry["terminated"] | (active & ts.terminated),
            num_turns=carry["num_turns"] + active.astype(jnp.int32),
            episode_return=carry["episode_return"] + reward,
            format_errors=carry["format_errors"]
            + (active & info["format_error"]).astype(jnp.int32),
            env_ids=carry["env_ids"],
            cache=cache,
            last_logits=last_logits,
            values=values,
        )
        per_turn = dict(reward=reward, process_reward=process_reward, start=turn_start,
                        active=active)
        if record_states:
            per_turn["state"] = carry["env_state"]
        return new_carry, per_turn


def _env_ids(timestep, batch):
    env_id = timestep.info.get("env_id") if isinstance(timestep.info, dict) else None
    if env_id is None:
        return jnp.zeros((batch,), jnp.int32)
    return env_id.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("env", "num_tasks", "group_size", "action_source"))
def scripted_rollout(env, key, *, num_tasks, group_size, action_source="oracle"):
    """A jitted rollout of the environment's scripted policy (oracle / demonstrator)."""
    return rollout(env, key, num_tasks=num_tasks, group_size=group_size,
                   action_source=action_source)


def render_trajectory(env, traj: Trajectory, row: int = 0) -> str:
    """Readable text of one row: the prompt, then alternating agent turns and replies."""
    import numpy as np

    tokens = np.asarray(traj.tokens[row])
    agent = np.asarray(traj.agent_mask[row]) > 0
    rewards = np.asarray(traj.rewards[row])
    turn_end = np.asarray(traj.turn_end_mask[row]) > 0
    length = int(traj.length[row])
    lines, start = [], 1  # position 0 is <bos>
    while start < length:
        end = start
        while end < length and agent[end] == agent[start]:
            end += 1
        text = env.codec.decode(tokens[start:end], stop_at_pad=False)
        if agent[start]:
            reward = rewards[start:end][turn_end[start:end]].sum()
            lines.append(f"[agent] {text}    (reward {reward:+.3f})")
        else:
            lines.append(f"[env]   {text}")
        start = end
    status = "success" if bool(traj.success[row]) else "failure"
    lines.append(f"-- {status}, {int(traj.num_turns[row])} turns, "
                 f"return {float(traj.episode_return[row]):+.3f}")
    return "\n".join(lines)

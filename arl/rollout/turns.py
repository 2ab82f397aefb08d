"""Playing turns: the policy writes a turn, the environment replies, the context grows.

`TurnPlayer.play` is a `lax.scan` over turns of a batch of episodes whose loop state is a
`RolloutCarry`. It is shared by `arl.rollout.rollout` (episodes from their first turn)
and Monte Carlo branching (`arl.rollout.branching`, forked mid-episode states). Rows
differ in length, so every write goes to each row's own offset (a scatter with
`mode="drop"`); nothing leaves the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from arl.envs.base import SCRIPTED_SOURCES, TokenChunk
from arl.text import codec as codec_lib
from arl.models import sampling as sampling_lib
from arl.models import transformer as transformer_lib
from arl.rollout import episode_keys as episode_keys_lib
from arl.rollout.trajectory import SamplingConfig
from arl.text.chat_template import env_chat_format

ACTION_SOURCES = ("model",) + SCRIPTED_SOURCES


@struct.dataclass
class RolloutCarry:
    """The loop state of `TurnPlayer.play`: the context so far and the episode tallies.

    Token-aligned arrays are `[B, S]`, per-row arrays `[B]`."""

    env_state: Any  # the environments' states (batched pytree)
    tokens: jax.Array  # int32 [B, S]: the context
    agent_mask: jax.Array  # float32 [B, S]
    observation_mask: jax.Array  # float32 [B, S]
    logp: jax.Array  # float32 [B, S]: behaviour log-probs of agent tokens
    rewards: jax.Array  # float32 [B, S]: turn rewards on each turn's last agent token
    process_rewards: jax.Array  # float32 [B, S]: process rewards, same positions
    turn_end: jax.Array  # float32 [B, S]: 1 on each turn's last agent token
    offset: jax.Array  # int32 [B]: valid tokens in the context
    done: jax.Array  # bool [B]: the episode has ended (or the row plays nothing)
    success: jax.Array  # bool [B]: the env's success after the row's latest turn
    terminated: jax.Array  # bool [B]
    num_turns: jax.Array  # int32 [B]: turns played
    episode_return: jax.Array  # float32 [B]
    format_errors: jax.Array  # int32 [B]
    env_ids: jax.Array  # int32 [B]: mixture member of the row
    # The policy's KV cache and the logits of the next token; None for scripted policies.
    cache: Any = None
    last_logits: jax.Array | None = None
    # float32 [B, S]: value-head outputs; None when the policy has no value head.
    values: jax.Array | None = None


def write_rows(buffer, chunk, offset, count):
    """buffer[b, offset[b] + i] = chunk[b, i] for i < count[b]; out-of-range dropped."""
    width = buffer.shape[1]
    idx = offset[:, None] + jnp.arange(chunk.shape[1])[None, :]
    idx = jnp.where(jnp.arange(chunk.shape[1])[None, :] < count[:, None], idx, width)
    return jax.vmap(lambda row, i, v: row.at[i].set(v, mode="drop"))(
        buffer, idx, chunk.astype(buffer.dtype))


def select_rows(pred, on_true, on_false):
    """Per-row select between two batched pytrees (pred is bool [B])."""

    def pick(a, b):
        p = pred.reshape(pred.shape + (1,) * (a.ndim - 1))
        return jnp.where(p, a, b)

    return jax.tree.map(pick, on_true, on_false)


def initial_carry(env_state, tokens, offset, env_ids, cache, last_logits, values, *,
                  done, success=None) -> RolloutCarry:
    """The loop state before the first turn `TurnPlayer.play` plays: the context `tokens`
    holds `offset` valid tokens per row; rows with `done` set play nothing; `success`
    (bool [B], default False) is the env's success in the state play starts from."""
    batch, width = tokens.shape
    zeros = jnp.zeros((batch, width), jnp.float32)
    if success is None:
        success = jnp.zeros((batch,), bool)
    return RolloutCarry(
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
        success=success,
        terminated=jnp.zeros((batch,), bool),
        num_turns=jnp.zeros((batch,), jnp.int32),
        episode_return=jnp.zeros((batch,), jnp.float32),
        format_errors=jnp.zeros((batch,), jnp.int32),
        env_ids=env_ids,
        cache=cache,
        last_logits=last_logits,
        values=values,
    )


@struct.dataclass
class TurnRecord:
    """Per-turn outputs of `TurnPlayer.play`, `[B, num_turns]` after the scan."""

    reward: jax.Array  # float32: the turn's reward
    process_reward: jax.Array  # float32: the turn's process reward
    start: jax.Array  # int32: context offset where the turn's agent tokens begin
    active: jax.Array  # bool: the turn was played
    success: jax.Array  # bool: the env's success after the turn (as before it if not played)
    state: Any = None  # the env state before the turn (with `record_states`)


@dataclasses.dataclass(frozen=True)
class TurnPlayer:
    """Plays turns of a batch of episodes: the policy writes a turn (KV-cached decoding or
    a scripted policy), the environment steps on it, its reply is appended to the
    context."""

    env: Any
    model: Any
    params: Any
    sampling: SamplingConfig
    action_source: str
    env_params: Any
    horizon: jax.Array

    def __post_init__(self):
        chat = env_chat_format(self.env)
        if chat is not None:  # before tracing: a template that rewrites earlier turns
            chat.check_turns(int(getattr(self.env, "max_turns", 1)),
                             f"env {getattr(self.env, 'name', type(self.env).__name__)!r}")

    def play(self, carry: RolloutCarry, first_turn, num_turns: int, key, *,
             record_states: bool = False) -> tuple[RolloutCarry, TurnRecord]:
        """Runs `num_turns` turns (a `lax.scan`); row b's i-th turn is turn
        `first_turn[b] + i` of its episode, played while the row is not done and below
        the horizon. Returns the final carry and the per-turn record `[B, num_turns]`
        (with `record_states`, the environment state before each turn too).

        `key`: one key for the batch, or `[B]` episode keys (`arl.rollout.episode_keys`):
        then each row's sampling and env-step keys come from its own episode's key and
        turn number, so the episode is the same however it is scheduled."""
        player = self
        per_layer = carry.cache is not None and transformer_lib.decodes_per_layer(
            self.model.config)
        if per_layer:
            # Once for all turns, not at every turn's decoding (`generate`).
            player = dataclasses.replace(self, params=transformer_lib.per_layer_params(
                self.params))
            carry = carry.replace(cache=carry.cache.per_layer())

        def scan_turn(carry, xs):
            i, turn_key = xs
            return player._turn(carry, first_turn + i, turn_key, record_states)

        if episode_keys_lib.is_batch(key):  # the rows' episode keys, the same every turn
            keys = jnp.broadcast_to(key, (num_turns,) + key.shape)
        else:
            keys = jax.random.split(key, num_turns)
        carry, per_turn = jax.lax.scan(scan_turn, carry, (jnp.arange(num_turns), keys))
        if per_layer:
            carry = carry.replace(cache=carry.cache.stacked())
        return carry, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), per_turn)

    def _turn(self, carry: RolloutCarry, turn_index, key, record_states):
        env, model, params, sampling = self.env, self.model, self.params, self.sampling
        codec = env.codec
        batch = carry.tokens.shape[0]
        use_model = self.action_source == "model"
        row_keys = None
        if episode_keys_lib.is_batch(key):  # [B] episode keys: this turn's from the row's
            row_keys, step_keys = episode_keys_lib.turn_keys(key, turn_index)
            act_key = row_keys[0]  # unused by `generate` with row_keys
        else:
            act_key, step_key = jax.random.split(key)
            step_keys = jax.random.split(step_key, batch)
        active = (~carry.done) & (turn_index < self.horizon)
        action_values = None
        if use_model:
            gen = sampling_lib.generate(
                model, params, carry.cache, carry.last_logits, act_key,
                max_new_tokens=env.action_len, eot_id=codec_lib.stop_ids(codec),
                pad_id=codec.pad_id,
                active=active, temperature=sampling.temperature, top_k=sampling.top_k,
                top_p=sampling.top_p, greedy=sampling.greedy, row_keys=row_keys)
            action = TokenChunk(tokens=gen.tokens, length=gen.length)
            action_logp = gen.logp
            cache, last_logits = gen.cache, gen.last_logits
            action_values = gen.values
        else:
            policy = getattr(env, f"{self.action_source}_action")
            action_keys = (jax.random.split(act_key, batch) if row_keys is None
                           else row_keys)
            action = jax.vmap(policy)(action_keys, carry.env_state, self.env_params)
            action = TokenChunk(
                tokens=action.tokens, length=jnp.where(active, action.length, 0))
            action_logp = jnp.zeros(action.tokens.shape, jnp.float32)
            cache, last_logits = None, None
        return self.respond(carry, active, action, action_logp, action_values, cache,
                            last_logits, step_keys, record_states)

    def respond(self, carry: RolloutCarry, active, action: TokenChunk, action_logp,
                action_values, cache, last_logits, step_keys, record_states=False):
        """The second half of a turn, once its action is decided: the environment steps
        on `action` (rows with `active`; `step_keys` [B]), the turn and the reply are
        written to the context and the reply is prefilled into `cache` (the cache and
        logits after the action). Rows that are not active are left as they are.
        Returns (the carry after the turn, its `TurnRecord`)."""
        env, model, params = self.env, self.model, self.params
        codec = env.codec
        batch, width = carry.tokens.shape
        use_model = self.action_source == "model"
        record_values = carry.values is not None
        new_state, ts = jax.vmap(env.step)(step_keys, carry.env_state, action,
                                           self.env_params)
        env_state = select_rows(active, new_state, carry.env_state)

        offset = carry.offset
        n_act = action.length
        ones = jnp.ones(action.tokens.shape, jnp.float32)
        tokens = write_rows(carry.tokens, action.tokens, offset, n_act)
        agent_mask = write_rows(carry.agent_mask, ones, offset, n_act)
        logp = write_rows(carry.logp, action_logp, offset, n_act)
        values = carry.values
        if record_values:
            values = write_rows(values, action_values, offset, n_act)
        info = ts.info
        reward = jnp.where(active, ts.reward, 0.0).astype(jnp.float32)
        process_reward = jnp.where(
            active, info.get("process_reward", jnp.zeros((batch,))), 0.0).astype(jnp.float32)
        has_turn = active & (n_act > 0)
        last = jnp.where(has_turn, offset + n_act - 1, width)
        rewards = write_rows(carry.rewards, reward[:, None], last, has_turn)
        process_rewards = write_rows(carry.process_rewards, process_reward[:, None], last,
                                     has_turn)
        turn_end = write_rows(carry.turn_end, jnp.ones((batch, 1)), last, has_turn)
        turn_start = offset
        offset = offset + n_act

        reply = ts.observation
        chat = env_chat_format(env)
        if chat is not None:  # the reply as the template's next user (or tool) turn
            last_id = jnp.take_along_axis(
                action.tokens, jnp.clip(n_act - 1, 0, action.tokens.shape[1] - 1)[:, None],
                axis=1)[:, 0]
            reply = jax.vmap(chat.wrap_reply)(reply, (n_act > 0) & (last_id == codec.eot_id))
        n_obs = jnp.where(active, reply.length, 0)
        tokens = write_rows(tokens, reply.tokens, offset, n_obs)
        observation_mask = write_rows(
            carry.observation_mask, jnp.ones(reply.tokens.shape, jnp.float32), offset, n_obs)
        if use_model:
            out = model.apply({"params": params}, reply.tokens, cache, num_valid=n_obs,
                              method="decode")
            cache = out.cache
            if record_values:
                values = write_rows(values, out.values, offset, n_obs)
            last_logits = jnp.where(
                (n_obs > 0)[:, None], sampling_lib.take_last_valid(out.logits, n_obs),
                last_logits)
        offset = offset + n_obs

        new_carry = RolloutCarry(
            env_state=env_state,
            tokens=tokens,
            agent_mask=agent_mask,
            observation_mask=observation_mask,
            logp=logp,
            rewards=rewards,
            process_rewards=process_rewards,
            turn_end=turn_end,
            offset=offset,
            done=carry.done | (active & ts.done),
            # Success is a property of the env's state, which a later turn can undo (e.g.
            # the bandit's "the last pull chose the better arm"): the latest one counts.
            success=jnp.where(active, info["success"], carry.success),
            terminated=carry.terminated | (active & ts.terminated),
            num_turns=carry.num_turns + active.astype(jnp.int32),
            episode_return=carry.episode_return + reward,
            format_errors=carry.format_errors
            + (active & info["format_error"]).astype(jnp.int32),
            env_ids=carry.env_ids,
            cache=cache,
            last_logits=last_logits,
            values=values,
        )
        per_turn = TurnRecord(reward=reward, process_reward=process_reward, start=turn_start,
                              active=active, success=new_carry.success,
                              state=carry.env_state if record_states else None)
        return new_carry, per_turn

"""History mode "per turn": every turn reads the conversation so far rendered afresh with
the checkpoint's own template, and is a training sample of its own.

    turn k:  context_k = apply_chat_template(conversation so far)   (host, one callback)
             prefill context_k into an empty KV cache, sample the turn a_k
             env.step(a_k) -> reply r_k, reward, done
             sample k = context_k ++ a_k   (agent mask on a_k)

`per_turn_rollout` plays a batch of episodes so, a `lax.scan` over turns, and returns
`TurnSamples`: `[B, K, L]` token buffers of the turn samples (K = max_turns, L =
`sample_length`) with the episode's outcome per row. The context is rendered on the host
(`arl.text.render_turns.TurnRenderer`) from what the device holds, so nothing about an
episode lives on the host between turns: the task's and the replies' token ids as the
env produced them (decoded, without the template text a host env writes around them)
and the ids of the policy's turns. It works for in-graph token envs and host envs alike,
and for tool envs in the template's tool convention (`arl.envs.tool_calling`): the
context is then `apply_chat_template(..., tools=...)` with each turn's calls as
structured `tool_calls` and each reply as the `tool` messages of its results.

Unlike "as generated" (`arl.rollout.rollout`), nothing is cached from turn to turn: each
turn prefills its whole context (the cost docs/checkpoints.md and
benchmarks/history_modes.py measure). A context longer than the room for it (`L -
action_len`, or the window's token budget) ends its episode (truncated, counted in
`TurnSamples.overflow`) unless a history window keeps it short (`HistoryWindow`).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.models import sampling as sampling_lib
from arl.models import transformer as transformer_lib
from arl.rollout.rollouts import default_row_params, env_ids_of, task_keys
from arl.rollout.trajectory import SamplingConfig, context_length, first_observation_length
from arl.rollout.trajectory import observation_length
from arl.rollout.turns import ACTION_SOURCES, select_rows, write_rows
from arl.text import codec as codec_lib
from arl.text.chunks import TokenChunk
from arl.text.chat_template import env_chat_format
from arl.text.render_turns import HistoryWindow, TurnRenderer

_log = logging.getLogger(__name__)


@struct.dataclass
class TurnSamples:
    """A batch of episodes played per turn: one training sample per played turn.

    `[B, K, L]` / `[B, K]` arrays are per turn (K = the env's max_turns), `[B]` per
    episode. A sample's tokens are its context (`context_length` tokens) followed by
    the turn the policy wrote (`length - context_length` tokens, `agent_mask` 1)."""

    tokens: jax.Array  # int32 [B, K, L]
    agent_mask: jax.Array  # float32 [B, K, L]
    behaviour_logp: jax.Array  # float32 [B, K, L]
    length: jax.Array  # int32 [B, K]
    context_length: jax.Array  # int32 [B, K]: where the turn starts
    active: jax.Array  # bool [B, K]: the turn was played (a sample)
    turn_rewards: jax.Array  # float32 [B, K]
    kept_turns: jax.Array  # int32 [B, K]: earlier exchanges the context kept (window)
    group_ids: jax.Array  # int32 [B]
    env_ids: jax.Array  # int32 [B]
    num_turns: jax.Array  # int32 [B]
    success: jax.Array  # bool [B]
    terminated: jax.Array  # bool [B]
    episode_return: jax.Array  # float32 [B]
    format_errors: jax.Array  # int32 [B]
    overflow: jax.Array  # bool [B]: ended because its next context did not fit
    # The conversation's env side as the env produced it: the first observation and
    # each turn's reply ([B, K, obs_len]), from which the contexts were rendered.
    prompt: jax.Array  # int32 [B, prompt_len]
    prompt_length: jax.Array  # int32 [B]
    replies: jax.Array  # int32 [B, K, obs_len]
    reply_length: jax.Array  # int32 [B, K]
    task_rows: jax.Array | None = None
    # The env's own per-episode statistics of the final states ({name: [B]}, envs with an
    # `episode_stats` hook, e.g. declared tools' calls), as `Trajectory.episode_stats`.
    episode_stats: Any = None
    # float32 [B, K, L]: the value head's output at each position of each sample (the
    # value of the state after token t), recorded while sampling; None without a head.
    values: jax.Array | None = None


def per_turn_error(env) -> str | None:
    """Why `env` cannot be played per turn (one line), or None."""
    chat = env_chat_format(env)
    codec = env.codec
    if chat is None or getattr(codec, "chat_template", None) is None:
        return ("it needs a checkpoint's chat template (model.hf_checkpoint with a "
                "chat_template): the context is rendered with it before every turn")
    if chat.reply_role == "user":
        return None
    if chat.reply_role == "tool" and getattr(env, "call_syntax", None) is not None:
        return None  # declared tools (`arl.envs.tool_calling`): rendered as tool use
    return (f"its replies are {chat.reply_role!r} messages, and per-turn contexts render "
            "replies as user turns, or as tool results of a ToolCallingEnvironment's "
            "declared tools (`call_syntax`, `tool_schemas`)")


def sample_length(env, window: HistoryWindow = HistoryWindow()) -> int:
    """L, the static length of a turn sample: room for the longest context the window
    keeps plus one turn. Without a window, the as-generated context of the whole episode
    (`context_length(env)`): a per-turn context is no longer than the growing one
    unless decoding and re-encoding the policy's turns lengthens them."""
    full = context_length(env)
    bound = full
    if window.turns:
        kept = min(window.turns, env.max_turns - 1)
        bound = first_observation_length(env) + kept * (env.action_len
                                                        + observation_length(env)) + env.action_len
    if window.tokens:
        bound = min(bound, window.tokens + env.action_len)
    return min(full, bound)


class _ContextHost:
    """The host side: renders every live row's context in one call (NumPy in, NumPy
    out, never raises: a row whose context cannot be rendered does not fit)."""

    def __init__(self, env, window: HistoryWindow, capacity: int):
        chat = env_chat_format(env)
        tool_calls = chat.reply_role == "tool"  # the template's tool convention
        self.renderer = TurnRenderer(
            env.codec, window, tools=env.tool_schemas if tool_calls else (),
            call_syntax=env.call_syntax if tool_calls else None)
        self.prompt_around, self.reply_around = chat.prompt_around, chat.reply_around
        self.stop_ids = codec_lib.stop_ids(env.codec)
        self.capacity = capacity
        self.pad_id = env.codec.pad_id

    def __call__(self, prompt, prompt_len, actions, action_len, replies, reply_len, turn,
                 live):
        # The callback may be handed device arrays: index NumPy copies, not them.
        (prompt, prompt_len, actions, action_len, replies, reply_len, turn, live) = (
            np.asarray(a) for a in (prompt, prompt_len, actions, action_len, replies,
                                    reply_len, turn, live))
        batch = prompt.shape[0]
        out = np.full((batch, self.capacity), self.pad_id, np.int32)
        length = np.zeros((batch,), np.int32)
        fits = np.zeros((batch,), bool)
        kept = np.zeros((batch,), np.int32)
        r = self.renderer
        for b in range(batch):
            if not live[b]:
                continue
            try:
                task = r.env_text(prompt[b, :prompt_len[b]], self.prompt_around)
                exchanges = [
                    (r.assistant_text(actions[b, j, :action_len[b, j]], self.stop_ids),
                     r.env_text(replies[b, j, :reply_len[b, j]], self.reply_around))
                    for j in range(int(turn))]
                context = r.context(task, exchanges, self.capacity)
            except Exception as error:  # pylint: disable=broad-except
                _log.error("per-turn context of row %d (turn %d) failed to render: %s: %s",
                           b, int(turn), type(error).__name__, error)
                context = None  # the row's episode ends (counted as overflow)
            if context is not None:
                out[b, :len(context.ids)] = context.ids
                length[b], fits[b], kept[b] = len(context.ids), True, context.kept
        return out, length, fits, kept


def per_turn_rollout(env, key: jax.Array, *, num_tasks: int, group_size: int,
                     model: transformer_lib.Transformer | None = None, params: Any = None,
                     sampling: SamplingConfig = SamplingConfig(),
                     horizon: jax.Array | int | None = None, action_source: str = "model",
                     env_params: Any = None, reset_keys: jax.Array | None = None,
                     window: HistoryWindow = HistoryWindow()) -> TurnSamples:
    """Plays `num_tasks * group_size` episodes of `env` per turn (module docstring); the
    arguments mean what they mean for `arl.rollout.rollout`. `window`: what of the
    conversation each context keeps."""
    if action_source not in ACTION_SOURCES:
        raise ValueError(f"action_source={action_source!r}; allowed values are {ACTION_SOURCES}")
    if action_source == "model" and (model is None or params is None):
        raise ValueError("action_source='model' needs both `model` and `params`.")
    trouble = per_turn_error(env)
    if trouble is not None:
        raise ValueError(f"env {getattr(env, 'name', type(env).__name__)!r} cannot be played "
                         f"with rollout.history='per_turn': {trouble}")
    batch = num_tasks * group_size
    if env_params is None:
        env_params = default_row_params(env, num_tasks, group_size)
    codec = env.codec
    turns, action_len = env.max_turns, env.action_len
    width = sample_length(env, window)
    capacity = width - action_len
    horizon = jnp.asarray(turns if horizon is None else horizon, jnp.int32)
    reset_key, turns_key = jax.random.split(key)
    if reset_keys is None:
        reset_keys = task_keys(reset_key, num_tasks, group_size)
    env_state, timestep = jax.vmap(env.reset)(reset_keys, env_params)
    task_rows = jax.vmap(env.task_row)(env_state) if hasattr(env, "task_row") else None
    prompt = timestep.observation
    use_model = action_source == "model"
    record_values = use_model and model.config.value_head
    if use_model:
        params = transformer_lib.gather_embedding(params, model.config)

    host = _ContextHost(env, window, capacity)
    shapes = (jax.ShapeDtypeStruct((batch, capacity), jnp.int32),
              jax.ShapeDtypeStruct((batch,), jnp.int32),
              jax.ShapeDtypeStruct((batch,), jnp.bool_),
              jax.ShapeDtypeStruct((batch,), jnp.int32))
    obs_len = env.obs_len
    zeros_b = jnp.zeros((batch,), jnp.int32)
    falses = jnp.zeros((batch,), bool)
    carry = dict(
        env_state=env_state,
        actions=jnp.full((batch, turns, action_len), codec.pad_id, jnp.int32),
        action_len=jnp.zeros((batch, turns), jnp.int32),
        replies=jnp.full((batch, turns, obs_len), codec.pad_id, jnp.int32),
        reply_len=jnp.zeros((batch, turns), jnp.int32),
        done=falses, success=falses, terminated=falses, overflow=falses,
        num_turns=zeros_b, episode_return=jnp.zeros((batch,), jnp.float32),
        format_errors=zeros_b)

    def play_turn(carry, xs):
        k, turn_key = xs
        act_key, step_key = jax.random.split(turn_key)
        live = (~carry["done"]) & (k < horizon)
        context, context_len, fits, kept = jax.pure_callback(
            host, shapes, prompt.tokens, prompt.length, carry["actions"], carry["action_len"],
            carry["replies"], carry["reply_len"], k, live)
        active = live & fits
        context_len = jnp.where(active, context_len, 0)
        tokens = jnp.concatenate(
            [context, jnp.full((batch, action_len), codec.pad_id, jnp.int32)], axis=1)
        if use_model:
            cache = transformer_lib.init_cache(model.config, batch, width, model.config.dtype)
            out = model.apply({"params": params}, context, cache, num_valid=context_len,
                              method="decode")
            last_logits = sampling_lib.take_last_valid(out.logits, context_len)
            gen = sampling_lib.generate(
                model, params, out.cache, last_logits, act_key, max_new_tokens=action_len,
                eot_id=codec_lib.stop_ids(codec), pad_id=codec.pad_id, active=active,
                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                greedy=sampling.greedy)
            action_tokens, n_act, action_logp = gen.tokens, gen.length, gen.logp
        else:
            policy = getattr(env, f"{action_source}_action")
            action = jax.vmap(policy)(jax.random.split(act_key, batch), carry["env_state"],
                                      env_params)
            action_tokens = action.tokens
            n_act = jnp.where(active, action.length, 0)
            action_logp = jnp.zeros(action_tokens.shape, jnp.float32)
        action = TokenChunk(tokens=action_tokens, length=n_act)
        new_state, ts = jax.vmap(env.step)(jax.random.split(step_key, batch),
                                           carry["env_state"], action, env_params)
        state = select_rows(active, new_state, carry["env_state"])
        ones = jnp.ones(action_tokens.shape, jnp.float32)
        sample = write_rows(tokens, action_tokens, context_len, n_act)
        agent_mask = write_rows(jnp.zeros(tokens.shape, jnp.float32), ones, context_len, n_act)
        logp = write_rows(jnp.zeros(tokens.shape, jnp.float32), action_logp, context_len,
                          n_act)
        values = None
        if record_values:
            values = write_rows(jnp.zeros(tokens.shape, jnp.float32), out.values,
                                jnp.zeros((batch,), jnp.int32), context_len)
            values = write_rows(values, gen.values, context_len, n_act)
        reward = jnp.where(active, ts.reward, 0.0).astype(jnp.float32)
        info = ts.info
        n_reply = jnp.where(active, ts.observation.length, 0)
        reply_tokens = jnp.where(active[:, None], ts.observation.tokens, codec.pad_id)
        new_carry = dict(
            env_state=state,
            actions=carry["actions"].at[:, k].set(jnp.where(active[:, None], action_tokens,
                                                            codec.pad_id)),
            action_len=carry["action_len"].at[:, k].set(n_act),
            replies=carry["replies"].at[:, k].set(reply_tokens.astype(jnp.int32)),
            reply_len=carry["reply_len"].at[:, k].set(n_reply),
            done=carry["done"] | (active & ts.done) | (live & ~fits),
            success=jnp.where(active, info["success"], carry["success"]),
            terminated=carry["terminated"] | (active & ts.terminated),
            overflow=carry["overflow"] | (live & ~fits),
            num_turns=carry["num_turns"] + active.astype(jnp.int32),
            episode_return=carry["episode_return"] + reward,
            format_errors=carry["format_errors"]
            + (active & info["format_error"]).astype(jnp.int32))
        record = dict(tokens=sample, agent_mask=agent_mask, logp=logp,
                      length=context_len + n_act, context_length=context_len, active=active,
                      reward=reward, kept=jnp.where(active, kept, 0), values=values)
        return new_carry, record

    keys = jax.random.split(turns_key, turns)
    carry, record = jax.lax.scan(play_turn, carry, (jnp.arange(turns), keys))
    per_turn = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), record)
    return TurnSamples(
        tokens=per_turn["tokens"], agent_mask=per_turn["agent_mask"],
        behaviour_logp=per_turn["logp"], length=per_turn["length"],
        context_length=per_turn["context_length"], active=per_turn["active"],
        turn_rewards=per_turn["reward"], kept_turns=per_turn["kept"],
        group_ids=jnp.repeat(jnp.arange(num_tasks, dtype=jnp.int32), group_size),
        env_ids=env_ids_of(timestep, batch), num_turns=carry["num_turns"],
        success=carry["success"], terminated=carry["terminated"],
        episode_return=carry["episode_return"], format_errors=carry["format_errors"],
        overflow=carry["overflow"], prompt=prompt.tokens, prompt_length=prompt.length,
        replies=carry["replies"], reply_length=carry["reply_len"], task_rows=task_rows,
        episode_stats=(jax.vmap(env.episode_stats)(carry["env_state"])
                       if hasattr(env, "episode_stats") else None),
        values=per_turn["values"])

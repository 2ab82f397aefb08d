"""The layout of a batch of multi-turn episodes: one left-aligned token buffer per row.

    <bos> prompt | turn 1 (agent) | reply 1 (env) | turn 2 (agent) | reply 2 | ... <pad>

with `S = context_length(env) = 1 + prompt_len + max_turns * (action_len + obs_len)` (more
with a checkpoint's chat format, `first_observation_length` / `observation_length`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import struct

from arl.text.chat_template import env_chat_format


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
    success: jax.Array  # bool [B]: the env's success at the end of the episode
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
    # agent tokens begin, whether it was played, the success after it; and, with
    # `record_turn_states`, the environment state before the turn (a pytree with leading
    # [B, max_turns] axes) from which Monte Carlo branching (`arl.rollout.branching`)
    # forks continuations.
    turn_rewards: jax.Array | None = None
    turn_starts: jax.Array | None = None
    turn_active: jax.Array | None = None
    turn_success: jax.Array | None = None  # bool [B, max_turns]: success after the turn
    turn_states: Any = None
    # With `rollout(..., record_projections=True)`: every layer's projection outputs at
    # each position the model read, {name: [num_layers, B, S, *features]} (layer-major,
    # as `Transformer(..., projections=)` takes them); None otherwise.
    projections: Any = None
    # int32 [B]: the row of the env's dataset each episode plays (envs with a `task_row`
    # hook, e.g. dataset_task), for Python reward functions' columns; None otherwise.
    task_rows: jax.Array | None = None
    # {metric name: float32 [B]}: per-episode statistics an env reports from its final
    # state (envs with an `episode_stats` hook, e.g. declared tools' invalid calls);
    # `rollout_metrics` logs their means. None otherwise.
    episode_stats: Any = None
    # int32 [B, S]: the parameter version (updates applied) that sampled each agent token,
    # read under `agent_mask`; set by partial rollouts (`arl.rollout.slots`), whose
    # episodes can span versions; None otherwise.
    token_versions: jax.Array | None = None


def chat_format(env):
    """The `arl.text.chat_template.ChatFormat` the rollout wraps `env`'s turns in (a
    checkpoint's codec, `HFCodec.from_pretrained`, or the env's own: a tool env in the
    template's tool convention), or None: arl's own codecs read `[bos] + prompt` and the
    raw replies."""
    return env_chat_format(env)


def first_observation_length(env) -> int:
    """Static length of what the policy reads before its first turn: `1 + prompt_len`
    (bos + prompt), or the prompt wrapped in the chat format's pieces."""
    chat = chat_format(env)
    return 1 + env.prompt_len if chat is None else chat.first_length(env.prompt_len)


def observation_length(env) -> int:
    """Static length of every later observation in the context: `obs_len`, or the reply
    wrapped in the chat format's pieces."""
    chat = chat_format(env)
    return env.obs_len if chat is None else chat.reply_length(env.obs_len)


def context_length(env) -> int:
    """The static length S of a rollout's token buffer for `env`."""
    return first_observation_length(env) + env.max_turns * (env.action_len
                                                             + observation_length(env))


def render_trajectory(env, traj: Trajectory, row: int = 0) -> str:
    """Readable text of one row: the prompt, then alternating agent turns and replies."""
    tokens = np.asarray(traj.tokens[row])
    agent = np.asarray(traj.agent_mask[row]) > 0
    rewards = np.asarray(traj.rewards[row])
    turn_end = np.asarray(traj.turn_end_mask[row]) > 0
    length = int(traj.length[row])
    # arl's own codecs: position 0 is <bos>; a chat format's pieces are shown as text.
    lines, start = [], 1 if chat_format(env) is None else 0
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

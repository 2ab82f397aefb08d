"""Environment wrappers: vmap batching, auto-reset, a data-valued turn horizon, and a
mixture of token environments in one batch.

Key convention (shared with every env in `arl.envs`): `step(key, ...)` draws its own
randomness from `jax.random.split(key)[0]` only; `split(key)[1]` is reserved for the
auto-reset, which is what gymnax does too, so `AutoReset(GymnaxEnvironment(...))` steps
bit-for-bit like gymnax's own auto-resetting `step`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from arl.text import chunks
from arl.envs.base import (Environment, TimeStep, TokenChunk, TokenEnvironment,
                           tree_select)


def _pad_observation(observation, size: int | None, pad_id: int | None):
    if isinstance(observation, TokenChunk) and size is not None:
        return chunks.pad_chunk(observation, size, pad_id)
    return observation


def finished_observation(observation, pad_id: int = 0):
    """The observation a finished episode returns: an empty chunk, or zeros."""
    if isinstance(observation, TokenChunk):
        return TokenChunk(jnp.full_like(observation.tokens, pad_id),
                          jnp.zeros_like(observation.length))
    return jax.tree.map(jnp.zeros_like, observation)


class Wrapper(Environment):
    """Delegates everything it does not override to the wrapped `env`."""

    def __init__(self, env: Environment):
        self.env = env

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not yet set (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.env, name)

    def default_params(self, *args, **kwargs):
        return self.env.default_params(*args, **kwargs)

    def reset(self, key, params):
        return self.env.reset(key, params)

    def step(self, key, state, action, params):
        return self.env.step(key, state, action, params)

    @property
    def observation_space(self):
        return self.env.observation_space

    @property
    def action_space(self):
        return self.env.action_space


class VmapWrapper(Wrapper):
    """Batched env: reset/step vmapped over a leading batch axis of keys, states,
    actions and (if `batched_params`) params; with `batched_params=False` one params
    pytree is shared by all rows."""

    def __init__(self, env: Environment, batched_params: bool = True):
        super().__init__(env)
        self.batched_params = batched_params
        axis = 0 if batched_params else None
        self._reset = jax.vmap(env.reset, in_axes=(0, axis))
        self._step = jax.vmap(env.step, in_axes=(0, 0, 0, axis))

    def reset(self, keys, params):
        return self._reset(keys, params)

    def step(self, keys, states, actions, params):
        return self._step(keys, states, actions, params)


def batch(env: Environment, batched_params: bool = True) -> VmapWrapper:
    return VmapWrapper(env, batched_params)


def broadcast_params(params, batch_size: int):
    """Repeat one params pytree along a new leading batch axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (batch_size,) + jnp.shape(x)),
                        params)


class AutoReset(Wrapper):
    """Resets a row as soon as its episode ends (terminated or truncated).

    The returned timestep keeps the finishing step's reward, flags and info (so
    `info["process_reward"]` is the finishing step's); its observation
    is the NEW episode's first observation and `info["final_observation"]` is the last
    observation of the finished episode (bootstrap from it when truncated). The reset
    key is `split(key)[1]`. Token observations are padded to max(prompt_len, obs_len),
    which is this wrapper's prompt_len and obs_len.
    """

    def __init__(self, env: Environment):
        super().__init__(env)
        if isinstance(env, TokenEnvironment) or hasattr(env, "prompt_len"):
            self.prompt_len = self.obs_len = max(env.prompt_len, env.obs_len)
            self._pad_id = env.codec.pad_id
        else:
            self.prompt_len = self.obs_len = None
            self._pad_id = None

    def _pad(self, observation):
        return _pad_observation(observation, self.obs_len, self._pad_id)

    def reset(self, key, params):
        state, timestep = self.env.reset(key, params)
        observation = self._pad(timestep.observation)
        info = {**timestep.info, "final_observation": observation}
        return state, timestep.replace(observation=observation, info=info)

    def step(self, key, state, action, params):
        _, key_reset = jax.random.split(key)
        stepped_state, stepped = self.env.step(key, state, action, params)
        reset_state, reset = self.env.reset(key_reset, params)
        final = self._pad(stepped.observation)
        done = stepped.done
        new_state = tree_select(done, reset_state, stepped_state)
        observation = tree_select(done, self._pad(reset.observation), final)
        info = {**stepped.info, "final_observation": final}
        return new_state, stepped.replace(observation=observation, info=info)


@struct.dataclass
class TurnHorizonParams:
    env_params: Any
    horizon: jax.Array  # int32: truncate once this many turns were taken


@struct.dataclass
class TurnHorizonState:
    env_state: Any
    turns: jax.Array  # int32
    terminated: jax.Array
    truncated: jax.Array
    info: dict  # the info of the last step, returned again while finished


class TurnHorizon(Wrapper):
    """Truncates an episode once turn >= h, with h DATA in the params (per row), so a
    curriculum (ScalingInter-RL) can raise h without recompiling. The inner env's own
    limits still apply; a finished episode stays finished (reward 0, and the last info
    again with `format_error` and `process_reward` zeroed)."""

    def __init__(self, env: Environment, default_horizon: int | None = None):
        super().__init__(env)
        self.default_horizon = default_horizon if default_horizon is not None else getattr(
            env, "max_turns", 2**30)
        if self.default_horizon < 1:
            raise ValueError(f"default_horizon must be >= 1, got {default_horizon}")

    def default_params(self, *args, horizon: int | None = None, **kwargs) -> TurnHorizonParams:
        horizon = self.default_horizon if horizon is None else horizon
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        return TurnHorizonParams(self.env.default_params(*args, **kwargs),
                                 jnp.asarray(horizon, jnp.int32))

    def reset(self, key, params: TurnHorizonParams):
        env_state, timestep = self.env.reset(key, params.env_params)
        state = TurnHorizonState(env_state, jnp.zeros((), jnp.int32), timestep.terminated,
                                 timestep.truncated, timestep.info)
        return state, timestep

    def step(self, key, state: TurnHorizonState, action, params: TurnHorizonParams):
        env_state, timestep = self.env.step(key, state.env_state, action, params.env_params)
        turns = state.turns + 1
        truncated = timestep.truncated | (~timestep.terminated & (turns >= params.horizon))
        live_ts = timestep.replace(truncated=truncated)
        live = TurnHorizonState(env_state, turns, timestep.terminated, truncated, timestep.info)
        frozen_info = dict(state.info)
        for key in ("format_error", "process_reward"):  # per-step values: none while finished
            if key in frozen_info:
                frozen_info[key] = jnp.zeros_like(frozen_info[key])
        pad_id = self.env.codec.pad_id if hasattr(self.env, "codec") else 0
        finished_ts = TimeStep(
            observation=finished_observation(timestep.observation, pad_id),
            reward=jnp.zeros_like(timestep.reward),
            terminated=state.terminated,
            truncated=state.truncated,
            info=frozen_info,
        )
        was_done = state.terminated | state.truncated
        return tree_select(was_done, (state, finished_ts), (live, live_ts))


# ---------------------------------------------------------------------------- mixture


@struct.dataclass
class MixtureParams:
    env_id: jax.Array  # int32, which member this row runs
    member_params: tuple


@struct.dataclass
class MixtureState:
    env_id: jax.Array
    member_states: tuple  # one state per member; only member env_id's is live


class Mixture(TokenEnvironment):
    """Several token environments (kinds or difficulties) in one batch.

    Each row's params carry `env_id`; reset/step dispatch with `lax.switch` on it
    (under vmap every member runs and the row's result is selected). The state is a
    union pytree holding one state per member (zeros for the members the row does not
    run). Static shapes are the max over the members: prompt_len, obs_len, action_len,
    max_turns; observations are padded, actions are passed through (members accept any
    action length). info = {"success", "turn", "format_error", "process_reward",
    "env_id"} (a fixed structure whatever the members add): the ids ERPO needs to pool
    statistics per environment, and each member's own process reward (float32; 0 for a
    member that defines none).
    """

    name = "mixture"

    def __init__(self, envs: Sequence[TokenEnvironment]):
        envs = tuple(envs)
        if len(envs) < 1:
            raise ValueError("envs must hold at least one token environment")
        for env in envs:
            if not isinstance(env, TokenEnvironment):
                raise ValueError(f"envs must be TokenEnvironments, got {type(env).__name__}")
            if getattr(env, "is_host_environment", False):
                # Under vmap every member steps every row: a host member would run its
                # tool on the other members' rows.
                raise ValueError(f"host environment {env.name!r} cannot be a Mixture "
                                 "member (train it on its own)")
        codec = envs[0].codec
        for env in envs[1:]:
            same = (env.codec is codec) or (
                env.codec.vocab_size == codec.vocab_size and env.codec.pad_id == codec.pad_id
                and env.codec.eot_id == codec.eot_id)
            if not same:
                raise ValueError("all members of a Mixture must share one codec")
        self.envs = envs
        self.codec = codec
        self.prompt_len = max(e.prompt_len for e in envs)
        self.obs_len = max(e.obs_len for e in envs)
        self.action_len = max(e.action_len for e in envs)
        self.max_turns = max(e.max_turns for e in envs)

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    @property
    def has_oracle(self) -> bool:
        return all(e.has_oracle for e in self.envs)

    @property
    def has_demonstrator(self) -> bool:
        return all(e.has_demonstrator for e in self.envs)

    def default_params(self, env_id: int = 0) -> MixtureParams:
        if not 0 <= env_id < self.num_envs:
            raise ValueError(f"env_id must be in [0, {self.num_envs}), got {env_id}")
        return MixtureParams(jnp.asarray(env_id, jnp.int32),
                             tuple(e.default_params() for e in self.envs))

    def batch_params(self, env_ids, member_params: Sequence | None = None) -> MixtureParams:
        """Params for a batch whose row b runs member env_ids[b]; `member_params`
        (unbatched, default: each member's defaults) are broadcast over the batch."""
        env_ids = jnp.asarray(env_ids, jnp.int32)
        member_params = tuple(member_params) if member_params is not None else tuple(
            e.default_params() for e in self.envs)
        return MixtureParams(env_ids, broadcast_params(member_params, env_ids.shape[0]))

    def _templates(self, key, member_params):
        """Zero states of every member (the parts of the union a row does not use)."""
        out = []
        for env, params in zip(self.envs, member_params):
            shapes = jax.eval_shape(lambda k, p, env=env: env.reset(k, p)[0], key, params)
            out.append(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        return tuple(out)

    def _common_info(self, info, env_id):
        process = info.get("process_reward", jnp.zeros((), jnp.float32))
        return {"success": info["success"], "turn": info["turn"],
                "format_error": info["format_error"],
                "process_reward": jnp.asarray(process, jnp.float32), "env_id": env_id}

    def process_reward(self, old_state: MixtureState, new_state: MixtureState,
                       params: MixtureParams):
        """The running member's process reward (dispatched on the row's env_id).
        `step` does not need it (members report theirs in their info)."""
        def branch(i):
            def run():
                value = self.envs[i].process_reward(old_state.member_states[i],
                                                    new_state.member_states[i],
                                                    params.member_params[i])
                return jnp.asarray(value, jnp.float32).reshape(())
            return run
        return jax.lax.switch(old_state.env_id, [branch(i) for i in range(self.num_envs)])

    def reset(self, key, params: MixtureParams):
        templates = self._templates(key, params.member_params)
        env_id = jnp.clip(params.env_id, 0, self.num_envs - 1).astype(jnp.int32)

        def branch(i):
            def run():
                state_i, ts = self.envs[i].reset(key, params.member_params[i])
                states = tuple(state_i if j == i else templates[j] for j in range(self.num_envs))
                ts = ts.replace(observation=chunks.pad_chunk(ts.observation, self.prompt_len,
                                                              self.codec.pad_id),
                                info=self._common_info(ts.info, env_id))
                return MixtureState(env_id, states), ts
            return run

        return jax.lax.switch(env_id, [branch(i) for i in range(self.num_envs)])

    def step(self, key, state: MixtureState, action: TokenChunk, params: MixtureParams):
        def branch(i):
            def run():
                state_i, ts = self.envs[i].step(key, state.member_states[i], action,
                                                params.member_params[i])
                states = tuple(state_i if j == i else state.member_states[j]
                               for j in range(self.num_envs))
                ts = ts.replace(observation=chunks.pad_chunk(ts.observation, self.obs_len,
                                                              self.codec.pad_id),
                                info=self._common_info(ts.info, state.env_id))
                return MixtureState(state.env_id, states), ts
            return run

        return jax.lax.switch(state.env_id, [branch(i) for i in range(self.num_envs)])

    def oracle_action(self, key, state: MixtureState, params: MixtureParams) -> TokenChunk:
        return self._dispatch_action("oracle_action", key, state, params)

    def demonstrator_action(self, key, state: MixtureState, params: MixtureParams) -> TokenChunk:
        return self._dispatch_action("demonstrator_action", key, state, params)

    def _dispatch_action(self, method, key, state, params):
        def branch(i):
            def run():
                chunk = getattr(self.envs[i], method)(key, state.member_states[i],
                                                      params.member_params[i])
                return chunks.pad_chunk(chunk, self.action_len, self.codec.pad_id)
            return run
        return jax.lax.switch(state.env_id, [branch(i) for i in range(self.num_envs)])

    def reward_bounds(self, params: MixtureParams):
        bounds = [e.reward_bounds(p) for e, p in zip(self.envs, params.member_params)]
        env_id = jnp.clip(params.env_id, 0, self.num_envs - 1)
        low = jnp.stack([jnp.asarray(b[0], jnp.float32) for b in bounds])[env_id]
        high = jnp.stack([jnp.asarray(b[1], jnp.float32) for b in bounds])[env_id]
        return low, high

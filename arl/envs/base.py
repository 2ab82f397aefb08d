"""The environment contract: timesteps, token chunks, spaces, `Environment`.

An environment is a set of pure functions over explicit state and params pytrees
(gymnax/jumanji-shaped; docs/environments.md):

    reset(key, params) -> (state, timestep)
    step(key, state, action, params) -> (state, timestep)

Functions are single-instance; batch with `jax.vmap` (see `arl.envs.wrappers.batch`).
Params are `flax.struct` pytrees, so one task/difficulty per row is just a batched
params pytree. A finished episode stays finished: `step` on a done state returns the
state unchanged, reward 0, the same terminated/truncated flags and an empty
observation (auto-reset is a wrapper).

Token environments (`TokenEnvironment`): the action is one agent turn as a padded
`TokenChunk`, every observation is the environment's reply as a padded `TokenChunk`
(the reset observation is the prompt). The TASK is sampled in `reset` from the reset
key, so the G members of a GRPO group given the SAME reset key get the same task;
their step keys may differ (they only drive env stochasticity such as slippery ice).

Process rewards: every token env also reports `info["process_reward"]` (float32 []), a
per-turn measure of progress toward the goal (e.g. information gained, distance closed)
computed by the `TokenEnvironment.process_reward` hook on the live transition. It is
kept apart from the outcome reward: it is NOT included in `TimeStep.reward`; trainers
decide whether and how to combine the two. It is 0 on reset, on the no-op steps of a
finished episode, and for envs that do not define one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.text import parsing
from arl.text.chunks import TokenChunk
from arl.text.codec import Codec, stop_ids

# The scripted policies an environment may implement (`oracle_action`,
# `demonstrator_action`), playable by `rollout(..., action_source=...)`.
SCRIPTED_SOURCES = ("demonstrator", "oracle")


@struct.dataclass
class TimeStep:
    """What an environment returns after reset/step.

    observation: TokenChunk for token envs; an array for vector envs.
    reward: float32 []; terminated, truncated: bool [].
    info: dict of fixed structure per env. Token envs always include `success` (bool []),
    `turn` (int32 [], turns taken so far), `format_error` (bool [], this step's
    action was malformed) and `process_reward` (float32 [], this turn's progress toward
    the goal as the env measures it; NOT included in `reward`, trainers combine the two;
    0 on reset, on a finished episode's no-op steps and where the env defines none).
    """

    observation: Any
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    info: dict

    @property
    def done(self) -> jax.Array:
        return jnp.logical_or(self.terminated, self.truncated)


# ----------------------------------------------------------------------------- spaces


class Discrete:
    """Integers in [0, n)."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = int(n)
        self.shape = ()
        self.dtype = jnp.int32

    def sample(self, key: jax.Array) -> jax.Array:
        return jax.random.randint(key, (), 0, self.n, dtype=jnp.int32)

    def contains(self, x) -> jax.Array:
        x = jnp.asarray(x)
        return jnp.logical_and(x >= 0, x < self.n)

    def __repr__(self) -> str:
        return f"Discrete({self.n})"


class Box:
    """Arrays of `shape` with low <= x <= high elementwise."""

    def __init__(self, low, high, shape: tuple[int, ...], dtype=jnp.float32):
        self.low = low
        self.high = high
        self.shape = tuple(shape)
        self.dtype = dtype

    def sample(self, key: jax.Array) -> jax.Array:
        low = jnp.broadcast_to(jnp.asarray(self.low, jnp.float32), self.shape)
        high = jnp.broadcast_to(jnp.asarray(self.high, jnp.float32), self.shape)
        # Unbounded boxes sample from a bounded core so samples stay finite.
        low = jnp.maximum(low, -1e6)
        high = jnp.minimum(high, 1e6)
        return jax.random.uniform(key, self.shape, jnp.float32, low, high).astype(self.dtype)

    def contains(self, x) -> jax.Array:
        x = jnp.asarray(x)
        return jnp.all(jnp.logical_and(x >= self.low, x <= self.high))

    def __repr__(self) -> str:
        return f"Box(shape={self.shape}, dtype={jnp.dtype(self.dtype).name})"


class TokenSpace:
    """Padded token chunks: ids in [0, vocab_size), at most `max_len` of them."""

    def __init__(self, vocab_size: int, max_len: int):
        self.vocab_size = int(vocab_size)
        self.max_len = int(max_len)
        self.shape = (self.max_len,)

    def sample(self, key: jax.Array) -> TokenChunk:
        """Uniformly random ids and a uniformly random length in [0, max_len]."""
        key_tokens, key_length = jax.random.split(key)
        tokens = jax.random.randint(key_tokens, self.shape, 0, self.vocab_size, jnp.int32)
        length = jax.random.randint(key_length, (), 0, self.max_len + 1, jnp.int32)
        return TokenChunk(tokens=tokens, length=length)

    def contains(self, chunk: TokenChunk) -> jax.Array:
        ok_ids = jnp.all((chunk.tokens >= 0) & (chunk.tokens < self.vocab_size))
        ok_len = (chunk.length >= 0) & (chunk.length <= self.max_len)
        return ok_ids & ok_len & (chunk.tokens.shape[-1] == self.max_len)

    def __repr__(self) -> str:
        return f"TokenSpace(vocab_size={self.vocab_size}, max_len={self.max_len})"


# ------------------------------------------------------------------------ environments


def tree_select(pred: jax.Array, on_true, on_false):
    """Leafwise `where(pred, a, b)` over two pytrees of the same structure."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


@dataclasses.dataclass(frozen=True)
class ParamRange:
    """The values a params field may take: `low <= x <= high` (`<` at an open end; None
    = unbounded). Checked on the host when a config overrides the field
    (`arl.envs.from_config.override_params`), never inside jit."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open
                                      else value > self.high):
            return False
        return True

    def __str__(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return (f"{'(' if self.low_open or self.low is None else '['}{low}, {high}"
                f"{')' if self.high_open or self.high is None else ']'}")


PROBABILITY = ParamRange(0.0, 1.0)
NON_NEGATIVE = ParamRange(0.0, None)


class Environment:
    """Abstract pure-function environment (single instance; batch via vmap)."""

    name: str = "environment"

    def default_params(self):
        raise NotImplementedError

    def param_ranges(self) -> Mapping[str, ParamRange]:
        """The valid values of the params fields a config may override
        (`config.env.params.<field>`), by field name; fields not listed accept any finite
        value of their dtype. Static constructor arguments may bound them (e.g. a task
        size <= the `max_n` the buffers were sized for)."""
        return {}

    def reset(self, key: jax.Array, params) -> tuple[Any, TimeStep]:
        raise NotImplementedError

    def step(self, key: jax.Array, state, action, params) -> tuple[Any, TimeStep]:
        raise NotImplementedError

    @property
    def observation_space(self):
        raise NotImplementedError

    @property
    def action_space(self):
        raise NotImplementedError


@struct.dataclass
class TokenEnvState:
    """Fields every built-in token environment's state has (subclasses add the task)."""

    turn: jax.Array  # int32 [], turns taken so far
    terminated: jax.Array  # bool []
    truncated: jax.Array  # bool []
    success: jax.Array  # bool []


class TokenEnvironment(Environment):
    """A multi-turn agent task spoken in tokens through `codec`.

    Static attributes: `codec`, `max_turns` (the env truncates after this many turns),
    `prompt_len` (length of the reset observation chunk), `obs_len` (length of every
    later observation chunk), `action_len` (the per-turn token budget the env expects;
    actions of any static length are accepted).

    Subclasses implement `_reset(key, params) -> (state, prompt_chunk)`,
    `_transition(key, state, content, params) -> (state, obs_chunk, reward, format_error)`
    on a live episode, `_info(state, format_error)`, `oracle_action` and
    `reward_bounds(params)`, and optionally `process_reward(old_state, new_state,
    params)`, `demonstrator_action` (a weaker scripted teacher; `has_demonstrator` says
    whether there is one, and configs asking for its demonstrations are refused up front
    without one) and `param_ranges()` (the valid values of config overrides of the
    params). This base class does the shared bookkeeping: sanitising the action, cutting
    it at the first end-of-turn token, counting turns, truncating at `max_turns`,
    keeping finished episodes finished, and adding `info["process_reward"]` (the hook's
    value on a live transition, 0 on reset and on a finished episode's no-op steps).

    Process reward vs reward: `TimeStep.reward` is the outcome reward (success, turn
    cost, format penalty); `info["process_reward"]` is a separate per-turn progress
    signal and is never added into `reward` by the env. Trainers combine them.
    """

    codec: Codec
    max_turns: int
    prompt_len: int
    obs_len: int
    action_len: int

    # -- spaces
    @property
    def observation_space(self) -> TokenSpace:
        return TokenSpace(self.codec.vocab_size, max(self.prompt_len, self.obs_len))

    @property
    def action_space(self) -> TokenSpace:
        return TokenSpace(self.codec.vocab_size, self.action_len)

    # -- helpers for subclasses
    def empty_observation(self, size: int | None = None) -> TokenChunk:
        size = self.obs_len if size is None else size
        return TokenChunk(
            tokens=jnp.full((size,), self.codec.pad_id, jnp.int32),
            length=jnp.zeros((), jnp.int32),
        )

    def _info(self, state, format_error: jax.Array) -> dict:
        return {
            "success": state.success,
            "turn": state.turn,
            "format_error": jnp.asarray(format_error, bool),
        }

    def process_reward(self, old_state, new_state, params) -> jax.Array:
        """float32 []: progress toward the goal made by one live transition
        `old_state -> new_state` (new_state already has the turn counted and any
        truncation applied). Default 0: the env defines no process reward. `step`
        traces it on every call but uses its value only when the episode was live
        (a finished episode's no-op step reports 0). Malformed turns should give 0
        (they leave the task state unchanged in the built-in envs, so a measure of the
        state difference gives 0)."""
        del old_state, new_state, params
        return jnp.zeros((), jnp.float32)

    @staticmethod
    def _with_process_reward(info: dict, value) -> dict:
        return {**info, "process_reward": jnp.asarray(value, jnp.float32).reshape(())}

    # -- the contract
    def reset(self, key: jax.Array, params) -> tuple[Any, TimeStep]:
        state, prompt = self._reset(key, params)
        timestep = TimeStep(
            observation=prompt,
            reward=jnp.zeros((), jnp.float32),
            terminated=jnp.zeros((), bool),
            truncated=jnp.zeros((), bool),
            info=self._with_process_reward(self._info(state, jnp.zeros((), bool)), 0.0),
        )
        return state, timestep

    def step(self, key: jax.Array, state, action: TokenChunk, params) -> tuple[Any, TimeStep]:

        tokens, length = parsing.sanitize(
            action.tokens, action.length, self.codec.vocab_size, self.codec.pad_id
        )
        content_length = parsing.turn_content_length(tokens, length, stop_ids(self.codec))
        # split(key)[1] is reserved for auto-reset (see arl.envs.wrappers).
        key_step, _ = jax.random.split(key)
        live_state, observation, reward, format_error = self._transition(
            key_step, state, TokenChunk(tokens=tokens, length=content_length), params
        )
        turn = state.turn + 1
        truncated = jnp.logical_and(~live_state.terminated, turn >= self.max_turns)
        live_state = live_state.replace(turn=turn, truncated=truncated)
        process = self.process_reward(state, live_state, params)
        live = TimeStep(
            observation=observation,
            reward=jnp.asarray(reward, jnp.float32),
            terminated=live_state.terminated,
            truncated=truncated,
            info=self._with_process_reward(self._info(live_state, format_error), process),
        )
        finished = TimeStep(
            observation=self.empty_observation(),
            reward=jnp.zeros((), jnp.float32),
            terminated=state.terminated,
            truncated=state.truncated,
            info=self._with_process_reward(self._info(state, jnp.zeros((), bool)), 0.0),
        )
        was_done = jnp.logical_or(state.terminated, state.truncated)
        return tree_select(was_done, (state, finished), (live_state, live))

    # -- rendering
    def render_chunk(self, chunk: TokenChunk) -> str:
        tokens = np.asarray(chunk.tokens)
        length = int(np.clip(np.asarray(chunk.length), 0, tokens.shape[-1]))
        return self.codec.decode(tokens[:length], stop_at_pad=False)

    def render(self, prompt: TokenChunk, actions: TokenChunk | None = None,
               observations: TokenChunk | None = None, rewards=None) -> str:
        """Readable text of a trajectory of ONE episode.

        `prompt` is the reset observation; `actions` / `observations` are stacked
        chunks with a leading turn axis [T, L] (as a `lax.scan` over turns produces);
        `rewards` optional [T]. Turns after the episode ended (empty observation and
        empty action) are skipped.
        """
        lines = [f"[env] {self.render_chunk(prompt)}"]
        if actions is None:
            return "\n".join(lines)
        num_turns = np.asarray(actions.tokens).shape[0]
        for t in range(num_turns):
            act = TokenChunk(np.asarray(actions.tokens)[t], np.asarray(actions.length)[t])
            obs = None
            if observations is not None:
                obs = TokenChunk(
                    np.asarray(observations.tokens)[t], np.asarray(observations.length)[t]
                )
            if int(act.length) == 0 and (obs is None or int(obs.length) == 0):
                continue
            lines.append(f"[agent] {self.render_chunk(act)}")
            if obs is not None:
                reward = "" if rewards is None else f"  (reward {float(np.asarray(rewards)[t]):+.3f})"
                lines.append(f"[env] {self.render_chunk(obs)}{reward}")
        return "\n".join(lines)

    # -- subclass hooks
    def _reset(self, key, params):
        raise NotImplementedError

    def _transition(self, key, state, content: TokenChunk, params):
        raise NotImplementedError

    def oracle_action(self, key: jax.Array, state, params) -> TokenChunk:
        """The scripted best action in `state` (demonstrations, baselines)."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no oracle_action: implement it to use "
            "action_source='oracle'")

    def demonstrator_action(self, key: jax.Array, state, params) -> TokenChunk:
        """Optional: a weaker scripted teacher than the oracle (behaviour-cloning
        demonstrations, `loss.sft_source` / `warm_start.sft_source` "demonstrator").
        Environments without one leave this default, and `has_demonstrator` is False."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no demonstrator_action: implement it, or use "
            "action_source='oracle'")

    @property
    def has_oracle(self) -> bool:
        """Whether `oracle_action` is implemented (by this class or a parent other than
        `TokenEnvironment`)."""
        return type(self).oracle_action is not TokenEnvironment.oracle_action

    @property
    def has_demonstrator(self) -> bool:
        """Whether `demonstrator_action` is implemented."""
        return type(self).demonstrator_action is not TokenEnvironment.demonstrator_action

    def supports_action_source(self, source: str) -> bool:
        """Whether `rollout(..., action_source=source)` can play this env: "model"
        always, "oracle" / "demonstrator" when the hook is implemented."""
        return {"model": True, "oracle": self.has_oracle,
                "demonstrator": self.has_demonstrator}.get(source, False)

    def reward_bounds(self, params) -> tuple[jax.Array, jax.Array]:
        """(lowest, highest) reward a single step can return under `params`."""
        raise NotImplementedError

"""Host environments: token environments whose task and turns are ordinary Python.

A `HostEnvironment` is a `TokenEnvironment` like any other (same `reset` / `step`
contract, trajectory layout, trainers, process rewards, branching, evaluation and
checkpoints), except that generating a task and answering a turn run as Python on the
host: a code interpreter, a SQL database, anything that is not JAX. The compiled rollout
reaches the host through one ordered `io_callback` per batch and turn
(`arl.envs.batched_callback`), and the host plays the live rows in parallel on a worker
pool with a per-row time limit (`step_timeout_s`).

State is data: a row's JAX state is `HostEnvState` (the usual fields, a task seed and a
small int32 `memory` vector), and nothing about an episode lives on the host between
calls, so rows may be gathered, copied and branched freely. A subclass implements, on the
host, `make_task`, `prompt`, `host_step` (never raising for anything the agent writes),
`host_oracle`, optionally `host_demonstrator`, and the traced `reward_bounds`.

docs/host_environments.md has the contract, how a turn crosses the boundary (codecs,
template text at the seams, batching), what it costs and where it runs on a mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import threading
import time
import traceback
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.envs.base import TokenChunk, TokenEnvironment, TokenEnvState
from arl.envs.batched_callback import batched_host_function
from arl.errors import one_line
from arl.text import seams
from arl.text.chat_template import env_chat_format
from arl.text.codec import decode_action, encode_action, encode_reply

_log = logging.getLogger(__name__)
_INIT_LOCK = threading.Lock()  # guards the lazy creation of an env's host-side state

HOST_ERROR_REPLY = "host error"
HOST_TIMEOUT_REPLY = "timeout"
POLICY_KINDS = ("oracle", "demonstrator")


# ----------------------------------------------------------------------- host records


@dataclasses.dataclass(frozen=True)
class HostEpisode:
    """What the host knows about one row when it plays a turn.

    task: `make_task(seed, params)`'s value (shared, do not mutate). params: the row's
    env params with NumPy scalar leaves. turn: turns taken so far. memory: the row's
    `memory_fields` as a dict of ints. seed: the task seed. step_seed: random bits of
    the step key (or, for a scripted policy, of its key): use `rng()` for randomness,
    never the global `random` (a resumed run must replay the same turns).
    """

    task: Any
    params: Any
    turn: int
    memory: dict
    seed: int
    step_seed: int = 0

    def rng(self) -> random.Random:
        return random.Random(self.step_seed)


@dataclasses.dataclass(frozen=True)
class HostTurn:
    """The outcome of one live turn, from `HostEnvironment.host_step`.

    reply: text of the next observation (cut to obs_len tokens). reward: the outcome
    reward of the turn. terminated / success: the episode ended / the task is solved.
    format_error: the turn was malformed. process_reward: progress toward the goal
    (`info["process_reward"]`, not part of `reward`). memory: fields of
    `memory_fields` that change (the others keep their values). host_error: set by
    the environment when the turn itself failed (an exception or a timeout).
    """

    reply: str
    reward: float = 0.0
    terminated: bool = False
    success: bool = False
    format_error: bool = False
    process_reward: float = 0.0
    memory: dict | None = None
    host_error: bool = False


@dataclasses.dataclass
class HostStats:
    """Counters of the host side of an environment (`HostEnvironment.host_stats`):
    callbacks made, rows seen, live rows stepped, wall seconds spent in the callbacks
    (the time the device waits on the host), turns that failed (an exception or a
    timeout in `host_step`) and the busiest call's seconds."""

    callbacks: int = 0
    rows: int = 0
    live_rows: int = 0
    seconds: float = 0.0
    host_errors: int = 0
    slowest_callback_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _log_failure(message: str, *args) -> None:
    """An error line for a failed host call (its last argument the exception): the
    exception on one line with where it was raised; the traceback only at DEBUG (a
    failing row is logged at every turn it fails, so a traceback each time would bury
    the log)."""
    *args, exc = args
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in " \
        f"{frames[-1].name})" if frames else ""
    _log.error(message, *args, f"{type(exc).__name__}: {one_line(exc)}{where}")
    _log.debug("traceback of the failure above", exc_info=exc)


def _seed_bits(key: jax.Array) -> jax.Array:
    """uint32 [2]: 64 random bits of `key` (typed or raw), a function of the key only."""
    return jax.random.bits(key, (2,), jnp.uint32)


def _seed_int(bits) -> int:
    bits = np.asarray(bits, np.uint64).reshape(-1)
    return int((int(bits[0]) << 32) | int(bits[1]))


# -------------------------------------------------------------------------- the state


@struct.dataclass
class HostEnvState(TokenEnvState):
    """A host env's state: the `TokenEnvState` fields plus what the host reads back."""

    seed: jax.Array  # uint32 [2]: the task seed (bits of the reset key)
    memory: jax.Array  # int32 [len(memory_fields)]
    process: jax.Array  # float32 []: the last turn's process reward (from the host)
    host_error: jax.Array  # bool []: the last turn failed on the host


# -------------------------------------------------------------------- the environment


class HostEnvironment(TokenEnvironment):
    """A token environment whose task and turns are host Python (module docstring).

    Static attributes (set by the subclass's constructor): `codec`, `max_turns`,
    `prompt_len`, `obs_len`, `action_len`, and optionally `memory_fields` (names of the
    int32 per-episode registers), `step_timeout_s` (backstop per row and turn, seconds),
    `max_workers` (the pool's threads; None: `arl.tools.default_max_workers()`) and
    `task_cache_size` (tasks kept by seed).
    """

    is_host_environment = True
    # The host writes the template's text around its prompt and replies (`seams`).
    writes_template_text = True

    # Chunk widths: what the subclass set (its text's budget) plus, with a chat template,
    # the tokens of the template's text the host writes around that text.
    @property
    def prompt_len(self) -> int:
        return self._prompt_budget + self._around_width(prompt=True)

    @prompt_len.setter
    def prompt_len(self, value: int) -> None:
        self._prompt_budget = value

    @property
    def obs_len(self) -> int:
        return self._obs_budget + self._around_width(prompt=False)

    @obs_len.setter
    def obs_len(self, value: int) -> None:
        self._obs_budget = value

    @property
    def reply_budget(self) -> int:
        """Tokens of the env's own reply text a chunk holds (`obs_len` as set), the
        template's text around it not counted."""
        return self._obs_budget

    def _around_width(self, prompt: bool) -> int:
        if getattr(self, "codec", None) is None:
            return 0
        chat = env_chat_format(self)
        if chat is None:
            return 0
        return seams.width(self.codec, *(chat.prompt_around if prompt else chat.reply_around))
    memory_fields: tuple[str, ...] = ()
    step_timeout_s: float | None = 60.0
    max_workers: int | None = None
    task_cache_size: int = 4096

    # -- host hooks (plain Python)
    def make_task(self, seed: int, params) -> Any:
        """The task of `seed` (deterministic); cached per (seed, params)."""
        raise NotImplementedError

    def prompt(self, task, params) -> str:
        raise NotImplementedError

    def initial_memory(self, task, params) -> dict:
        """Initial values of `memory_fields` (default all 0)."""
        del task, params
        return {}

    def host_step(self, episode: HostEpisode, action: str) -> HostTurn:
        raise NotImplementedError

    def reply_ids(self, text: str) -> tuple[np.ndarray, int]:
        """(int32 [obs_len] ids, length) of the reply `text` (default `text_ids`: cut to
        obs_len tokens, ending in ".."); an env whose replies the template writes
        otherwise (a JSON string) overrides it."""
        return self.text_ids(text, self.obs_len)

    def text_ids(self, text: str, size: int, render=None, prompt: bool = False
                 ) -> tuple[np.ndarray, int]:
        """(int32 [size] ids, length) of the reply (or, `prompt`, the prompt) `text`:
        with a chat template, the template's text around it and `render(text)` (how the
        template writes it, e.g. a JSON string) tokenized as one text, cut as text to fit
        (`seams.encode_between`); else `encode_reply`."""
        chat = env_chat_format(self)
        if chat is None:
            return encode_reply(self.codec, text if render is None else render(text), size)
        head, tail = chat.prompt_around if prompt else chat.reply_around
        return seams.encode_between(self.codec, head, text, tail, size, render=render)

    def host_oracle(self, episode: HostEpisode) -> str:
        raise NotImplementedError

    def host_demonstrator(self, episode: HostEpisode, rng: random.Random) -> str:
        """A weaker teacher's turn (default: the oracle's)."""
        del rng
        return self.host_oracle(episode)

    @property
    def has_oracle(self) -> bool:
        """Whether `host_oracle` is implemented (configs that play it are refused up front,
        in one line, without it)."""
        return type(self).host_oracle is not HostEnvironment.host_oracle

    @property
    def has_demonstrator(self) -> bool:
        """Whether `host_demonstrator` is implemented, or the oracle it defaults to."""
        return (type(self).host_demonstrator is not HostEnvironment.host_demonstrator
                or self.has_oracle)

    # -- host machinery
    def _host_init(self):
        """Creates the host-side state (lock, task cache, counters; the pool on first
        use). Lazy, so a subclass's constructor need not call it."""
        if getattr(self, "_host_ready", False):
            return
        with _INIT_LOCK:
            if getattr(self, "_host_ready", False):
                return
            self._lock = threading.Lock()
            self._tasks: OrderedDict = OrderedDict()
            self._stats = HostStats()
            self._pool = None
            self._host_ready = True

    @property
    def host_stats(self) -> HostStats:
        """A copy of the host-side counters (`HostStats`)."""
        self._host_init()
        with self._lock:
            return dataclasses.replace(self._stats)

    def reset_host_stats(self) -> None:
        self._host_init()
        with self._lock:
            self._stats = HostStats()

    def pool(self):
        """The worker pool of this environment (created on first use)."""
        from arl.tools.pool import ToolPool  # the tools need nothing from arl.envs

        self._host_init()
        with self._lock:
            if self._pool is None:
                self._pool = ToolPool(self.max_workers)
            return self._pool

    def close(self) -> None:
        """Releases the worker pool (a later call creates a new one)."""
        self._host_init()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(wait=False)

    def task(self, seed: int, params) -> Any:
        """`make_task(seed, params)` through the cache."""
        self._host_init()
        cache_key = (int(seed), _params_key(params))
        with self._lock:
            if cache_key in self._tasks:
                self._tasks.move_to_end(cache_key)
                return self._tasks[cache_key]
        task = self.make_task(int(seed), params)
        with self._lock:
            self._tasks[cache_key] = task
            while len(self._tasks) > max(self.task_cache_size, 1):
                self._tasks.popitem(last=False)
        return task

    def _memory_dict(self, row) -> dict:
        return {name: int(row[i]) for i, name in enumerate(self.memory_fields)}

    def _memory_row(self, base: dict, changes: dict | None) -> np.ndarray:
        merged = dict(base)
        if changes:
            unknown = sorted(set(changes) - set(self.memory_fields))
            if unknown:
                raise ValueError(f"memory fields {unknown} are not in memory_fields="
                                 f"{self.memory_fields}")
            merged.update(changes)
        values = [int(np.clip(int(merged.get(name, 0)), -2 ** 31, 2 ** 31 - 1))
                  for name in self.memory_fields]
        return np.asarray(values, np.int32).reshape(len(self.memory_fields))

    def _row_params(self, treedef, leaves, row: int):
        return jax.tree.unflatten(treedef, [np.asarray(leaf)[row] for leaf in leaves])

    def _record(self, rows: int, live: int, seconds: float, errors: int = 0) -> None:
        with self._lock:
            s = self._stats
            s.callbacks += 1
            s.rows += rows
            s.live_rows += live
            s.seconds += seconds
            s.host_errors += errors
            s.slowest_callback_s = max(s.slowest_callback_s, seconds)

    def _map_rows(self, fn, items, failure):
        """`[fn(item) for item in items]` on the pool (one row: inline), each row
        bounded by `step_timeout_s`; a row that raised or timed out becomes
        `failure(message, timed_out)`."""
        from arl.tools.results import ExecutionResult, Status

        if not items:
            return []
        if len(items) == 1 and self.step_timeout_s is None:
            try:
                return [fn(items[0])]
            except Exception as exc:  # pylint: disable=broad-except
                _log_failure("%s: host turn failed for row %s: %s", self.name, items[0], exc)
                return [failure(f"{type(exc).__name__}: {exc}", False)]
        results = self.pool().map(fn, items, timeout_s=self.step_timeout_s)
        out = []
        for item, result in zip(items, results):
            if isinstance(result, ExecutionResult):  # the pool caught a failure
                timed_out = result.status is Status.TIMEOUT
                _log.error("%s: host turn %s for row %s: %s", self.name,
                           "timed out" if timed_out else "failed", item,
                           one_line(result.observation))
                out.append(failure(result.observation, timed_out))
            else:
                out.append(result)
        return out

    # -- the three host callbacks (NumPy in, NumPy out, never raise)
    def _host_reset(self, treedef, seeds, *leaves):
        start = time.monotonic()
        batch = seeds.shape[0]
        tokens = np.full((batch, self.prompt_len), self.codec.pad_id, np.int32)
        lengths = np.zeros((batch,), np.int32)
        memory = np.zeros((batch, len(self.memory_fields)), np.int32)
        errors = 0
        for b in range(batch):
            try:
                params = self._row_params(treedef, leaves, b)
                task = self.task(_seed_int(seeds[b]), params)
                tokens[b], lengths[b] = self.text_ids(self.prompt(task, params),
                                                      self.prompt_len, prompt=True)
                memory[b] = self._memory_row({}, self.initial_memory(task, params))
            except Exception as exc:  # pylint: disable=broad-except
                _log_failure("%s: reset failed for row %d (task seed %d): %s", self.name, b,
                             _seed_int(seeds[b]), exc)
                tokens[b], lengths[b] = self.text_ids(HOST_ERROR_REPLY, self.prompt_len,
                                                      prompt=True)
                errors += 1
        self._record(batch, batch, time.monotonic() - start, errors)
        return tokens, lengths, memory

    def _host_step(self, treedef, seeds, turns, memory, live, step_bits, tokens, lengths,
                   *leaves):
        start = time.monotonic()
        batch = seeds.shape[0]
        reply = np.full((batch, self.obs_len), self.codec.pad_id, np.int32)
        reply_len = np.zeros((batch,), np.int32)
        reward = np.zeros((batch,), np.float32)
        terminated = np.zeros((batch,), bool)
        success = np.zeros((batch,), bool)
        format_error = np.zeros((batch,), bool)
        process = np.zeros((batch,), np.float32)
        host_error = np.zeros((batch,), bool)
        new_memory = np.array(memory, np.int32, copy=True)
        rows = [b for b in range(batch) if bool(live[b])]

        def episode_of(b):
            params = self._row_params(treedef, leaves, b)
            return HostEpisode(task=self.task(_seed_int(seeds[b]), params), params=params,
                               turn=int(turns[b]), memory=self._memory_dict(memory[b]),
                               seed=_seed_int(seeds[b]), step_seed=_seed_int(step_bits[b]))

        def play(b):
            return self.host_step(episode_of(b),
                                  decode_action(self.codec, tokens[b], lengths[b]))

        def failure(message, timed_out):
            return HostTurn(reply=HOST_TIMEOUT_REPLY if timed_out else HOST_ERROR_REPLY,
                            terminated=True, host_error=True)

        turns_out = self._map_rows(play, rows, failure)
        errors = 0
        for b, turn in zip(rows, turns_out):
            try:
                if not isinstance(turn, HostTurn):
                    raise TypeError(f"host_step returned {type(turn).__name__}, not HostTurn")
                row_memory = self._memory_row(self._memory_dict(memory[b]), turn.memory)
                reward[b] = np.float32(turn.reward)
                process[b] = np.float32(turn.process_reward)
                if not (np.isfinite(reward[b]) and np.isfinite(process[b])):
                    raise ValueError(f"non-finite reward {turn.reward!r} or process reward "
                                     f"{turn.process_reward!r}")
                reply[b], reply_len[b] = self.reply_ids(str(turn.reply))
                terminated[b], success[b] = bool(turn.terminated), bool(turn.success)
                format_error[b], host_error[b] = bool(turn.format_error), bool(turn.host_error)
                new_memory[b] = row_memory
            except Exception as exc:  # pylint: disable=broad-except
                _log_failure("%s: bad host turn for row %d (task seed %d): %s", self.name, b,
                             _seed_int(seeds[b]), exc)
                reward[b] = process[b] = 0.0
                reply[b], reply_len[b] = self.reply_ids(HOST_ERROR_REPLY)
                terminated[b], success[b], format_error[b] = True, False, False
                host_error[b] = True
            errors += int(host_error[b])
        self._record(batch, len(rows), time.monotonic() - start, errors)
        return (reply, reply_len, reward, terminated, success, format_error, process,
                new_memory, host_error)

    def _host_policy(self, kind, treedef, seeds, turns, memory, live, key_bits, *leaves):
        start = time.monotonic()
        batch = seeds.shape[0]
        action = np.full((batch, self.action_len), self.codec.pad_id, np.int32)
        length = np.zeros((batch,), np.int32)
        rows = [b for b in range(batch) if bool(live[b])]
        errors = 0
        for b in rows:
            try:
                params = self._row_params(treedef, leaves, b)
                episode = HostEpisode(
                    task=self.task(_seed_int(seeds[b]), params), params=params,
                    turn=int(turns[b]), memory=self._memory_dict(memory[b]),
                    seed=_seed_int(seeds[b]), step_seed=_seed_int(key_bits[b]))
                if kind == "oracle":
                    text = self.host_oracle(episode)
                else:
                    text = self.host_demonstrator(episode, episode.rng())
                action[b], length[b] = encode_action(self.codec, str(text), self.action_len)
            except Exception as exc:  # pylint: disable=broad-except
                _log_failure("%s: %s policy failed for row %d (task seed %d): %s", self.name,
                             kind, b, _seed_int(seeds[b]), exc)
                errors += 1  # an empty turn: a format error for the env
        self._record(batch, len(rows), time.monotonic() - start, errors)
        return action, length

    # -- traced side
    def _result_shapes_step(self, batch):
        m = len(self.memory_fields)
        s = jax.ShapeDtypeStruct
        return (s((batch, self.obs_len), jnp.int32), s((batch,), jnp.int32),
                s((batch,), jnp.float32), s((batch,), jnp.bool_), s((batch,), jnp.bool_),
                s((batch,), jnp.bool_), s((batch,), jnp.float32), s((batch, m), jnp.int32),
                s((batch,), jnp.bool_))

    def _reset(self, key, params):
        leaves, treedef = jax.tree.flatten(params)
        m = len(self.memory_fields)

        def shapes(batch):
            s = jax.ShapeDtypeStruct
            return (s((batch, self.prompt_len), jnp.int32), s((batch,), jnp.int32),
                    s((batch, m), jnp.int32))

        seed = _seed_bits(key)
        fn = batched_host_function(functools.partial(self._host_reset, treedef), shapes)
        tokens, length, memory = fn(seed, *leaves)
        false = jnp.zeros((), bool)
        state = HostEnvState(
            turn=jnp.zeros((), jnp.int32), terminated=false, truncated=false, success=false,
            seed=seed, memory=memory, process=jnp.zeros((), jnp.float32), host_error=false)
        return state, TokenChunk(tokens=tokens, length=length)

    def _transition(self, key, state: HostEnvState, content: TokenChunk, params):
        leaves, treedef = jax.tree.flatten(params)
        live = ~(state.terminated | state.truncated)
        fn = batched_host_function(functools.partial(self._host_step, treedef),
                                   self._result_shapes_step)
        (reply, reply_len, reward, terminated, success, format_error, process, memory,
         host_error) = fn(state.seed, state.turn, state.memory, live, _seed_bits(key),
                          content.tokens, content.length, *leaves)
        new_state = state.replace(terminated=terminated, success=success, memory=memory,
                                  process=process, host_error=host_error)
        return new_state, TokenChunk(tokens=reply, length=reply_len), reward, format_error

    def _info(self, state, format_error):
        info = super()._info(state, format_error)
        info["host_error"] = state.host_error
        return info

    def process_reward(self, old_state, new_state: HostEnvState, params) -> jax.Array:
        """The host's process reward of the turn (`HostTurn.process_reward`)."""
        del old_state, params
        return new_state.process

    def _scripted(self, kind, key, state: HostEnvState, params) -> TokenChunk:
        leaves, treedef = jax.tree.flatten(params)
        live = ~(state.terminated | state.truncated)

        def shapes(batch):
            s = jax.ShapeDtypeStruct
            return (s((batch, self.action_len), jnp.int32), s((batch,), jnp.int32))

        fn = batched_host_function(functools.partial(self._host_policy, kind, treedef),
                                   shapes)
        tokens, length = fn(state.seed, state.turn, state.memory, live, _seed_bits(key),
                            *leaves)
        return TokenChunk(tokens=tokens, length=length)

    def oracle_action(self, key, state, params) -> TokenChunk:
        """`host_oracle`'s turn, as token ids (end-of-turn appended)."""
        return self._scripted("oracle", key, state, params)

    def demonstrator_action(self, key, state, params) -> TokenChunk:
        """`host_demonstrator`'s turn, as token ids (end-of-turn appended)."""
        return self._scripted("demonstrator", key, state, params)


def _params_key(params) -> tuple:
    """A hashable summary of a row's params (the task cache key)."""
    return tuple((np.asarray(leaf).dtype.str, np.asarray(leaf).tobytes())
                 for leaf in jax.tree.leaves(params))


def is_host_environment(env) -> bool:
    """Whether `env` (or the env a wrapper delegates to) runs on the host."""
    return bool(getattr(env, "is_host_environment", False))

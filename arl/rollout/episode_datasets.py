"""Datasets on disk with tensorflow-datasets, without TensorFlow: fixed evaluation task
sets and expert demonstrations.

Both are `tfds.core.GeneratorBasedBuilder`s written as ``array_record`` files (tfds 4.9
prepares and reads those without TensorFlow) and read back through
`tfds.builder_from_directory(path).as_data_source()` and a grain `MapDataset`:

* `build_task_set(data_dir, env_config, num_tasks=..., seed=...)`: one record per task,
  the task's reset key (PRNG key data: environments draw the task in `reset` from it), its
  environment id (mixture member) and its prompt tokens. `load_task_set` + `rollout(...,
  reset_keys=tasks.reset_keys, env_params=tasks.env_params(env))` replays exactly these
  tasks, so checkpoints and methods are compared on the same questions.
* `build_demonstrations(data_dir, env_config, num_episodes=..., action_source=...)`: one
  record per episode played by the environment's scripted policy (`"oracle"`: the
  optimum; `"demonstrator"`: the weaker teacher), played by `arl.rollout.rollout` —
  tokens, agent mask, length, success, return, env id.
* `load_demonstrations(path)` puts a demonstration set on the device once;
  `sample_demonstrations(demos, key, batch_size)` is jittable and draws a minibatch by
  index, which is how the SFT term of the token trainer consumes a set (`loss.sft_dataset`).

Each dataset directory (``<data_dir>/<builder>/<version>``) is what the load functions
and `config.loss.sft_dataset` take; the environment config it was built for is stored in
its ``metadata.json`` and checked on load.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import struct

from arl import envs as envs_lib
from arl.data import records
from arl.rollout.rollouts import env_ids_of, rollout
from arl.rollout.trajectory import context_length


def _env_config_dict(env_config) -> dict[str, Any]:
    """`config.env` (ConfigDict or dict) in one canonical JSON form, for comparisons."""
    if isinstance(env_config, ml_collections.ConfigDict):
        env_config = json.loads(env_config.to_json_best_effort())
    env_config = json.loads(json.dumps(dict(env_config)))
    members = [{"name": m["name"], "kwargs": dict(m.get("kwargs", {}) or {}),
                "params": dict(m.get("params", {}) or {})}
               for m in env_config.get("members", ()) or ()]
    return {"name": env_config["name"], "kwargs": dict(env_config.get("kwargs", {}) or {}),
            "members": members, "params": dict(env_config.get("params", {}) or {})}


def _task_params(env, env_config: Mapping[str, Any], num_rows: int):
    """Per-row params of `num_rows` tasks (task i: mixture member i % members)."""
    return envs_lib.task_params(env, env_config, envs_lib.member_of_task(env, num_rows))


# ---------------------------------------------------------------------------- task sets
@struct.dataclass
class TaskSet:
    """Fixed tasks: `reset_keys` (typed keys [N]) and `env_ids` (int32 [N])."""

    reset_keys: jax.Array
    env_ids: jax.Array
    prompts: jax.Array  # int32 [N, prompt_len], for inspection
    # The `config.env` the set was built with (canonical JSON), for its params overrides.
    env_config_json: str = struct.field(pytree_node=False, default="{}")

    def env_params(self, env):
        """Per-row params running each task in its environment (mixture member), with
        the set's `config.env` params overrides."""
        return envs_lib.task_params(env, json.loads(self.env_config_json), self.env_ids)


def build_task_set(data_dir, env_config, *, num_tasks: int, seed: int = 0) -> str:
    """Writes `num_tasks` fixed tasks of the env in `env_config`; returns the dataset dir.

    Task i runs mixture member i % num_members (a single env: member 0)."""
    if not isinstance(num_tasks, int) or num_tasks < 1:
        raise ValueError(f"num_tasks must be an integer >= 1, got {num_tasks!r}")
    env_config = _env_config_dict(env_config)
    env = envs_lib.make_env(env_config)
    keys = jax.random.split(jax.random.key(seed), num_tasks)
    params = _task_params(env, env_config, num_tasks)
    _, timestep = jax.jit(jax.vmap(env.reset))(keys, params)
    key_data = np.asarray(jax.random.key_data(keys))
    env_ids = np.asarray(env_ids_of(timestep, num_tasks))
    prompts = np.asarray(timestep.observation.tokens)

    def generate():
        for i in range(num_tasks):
            yield i, {"index": i, "reset_key": key_data[i], "env_id": env_ids[i],
                      "prompt": prompts[i]}

    task_set_cls = records.builder_classes()[0]
    return records.prepare(task_set_cls, data_dir, env_config=env_config,
                           num_examples=num_tasks, seed=seed, generate=generate,
                           extra_metadata={"key_shape": list(key_data.shape[1:]),
                                           "prompt_len": int(prompts.shape[1])})


def load_task_set(path: str, *, env_config=None) -> TaskSet:
    """Reads a task set; with `env_config`, checks it was built for that environment."""
    arrays, metadata = records.read_all(path)
    _check_env_config(path, metadata, env_config)
    return TaskSet(reset_keys=jax.random.wrap_key_data(jnp.asarray(arrays["reset_key"])),
                   env_ids=jnp.asarray(arrays["env_id"], jnp.int32),
                   prompts=jnp.asarray(arrays["prompt"], jnp.int32),
                   env_config_json=json.dumps(metadata.get("env_config") or {},
                                              sort_keys=True))


def _check_env_config(path, metadata, env_config):
    if env_config is None:
        return
    expected = _env_config_dict(env_config)
    if metadata.get("env_config") != expected:
        raise ValueError(f"dataset {path!r} was built for env {metadata.get('env_config')}, "
                         f"not {expected}")


# ---------------------------------------------------------------------------- demonstrations
@struct.dataclass
class Demonstrations:
    """Demonstration episodes on the device; attribute names match `Trajectory`."""

    tokens: jax.Array  # int32 [N, S]
    agent_mask: jax.Array  # float32 [N, S]
    success: jax.Array  # bool [N]
    episode_return: jax.Array  # float32 [N]
    env_ids: jax.Array  # int32 [N]


def build_demonstrations(data_dir, env_config, *, num_episodes: int, seed: int = 0,
                         action_source: str = "oracle", chunk_size: int = 256) -> str:
    """Plays `num_episodes` episodes of the env's scripted policy and writes them.

    Returns the dataset directory (what `loss.sft_dataset` and `load_demonstrations`
    take). Episodes are generated `chunk_size` at a time by one compiled rollout."""
    if action_source not in ("oracle", "demonstrator"):
        raise ValueError(f"action_source={action_source!r}; allowed values are "
                         "('oracle', 'demonstrator')")
    if not isinstance(num_episodes, int) or num_episodes < 1:
        raise ValueError(f"num_episodes must be an integer >= 1, got {num_episodes!r}")
    env_config = _env_config_dict(env_config)
    env = envs_lib.make_env(env_config)
    chunk_size = min(chunk_size, num_episodes)
    base_key = jax.random.key(seed)
    play = jax.jit(lambda key, env_params: rollout(
        env, key, num_tasks=chunk_size, group_size=1, action_source=action_source,
        env_params=env_params))
    env_params = _task_params(env, env_config, chunk_size)

    def generate():
        index = 0
        for chunk in range(-(-num_episodes // chunk_size)):
            traj = jax.device_get(play(jax.random.fold_in(base_key, chunk), env_params))
            for row in range(min(chunk_size, num_episodes - index)):
                yield index, {
                    "index": index,
                    "tokens": traj.tokens[row],
                    "agent_mask": (traj.agent_mask[row] > 0).astype(np.uint8),
                    "length": traj.length[row],
                    "num_turns": traj.num_turns[row],
                    "success": traj.success[row],
                    "episode_return": traj.episode_return[row],
                    "env_id": traj.env_ids[row],
                }
                index += 1

    demonstrations_cls = records.builder_classes()[1]
    return records.prepare(demonstrations_cls, data_dir, env_config=env_config,
                           num_examples=num_episodes, seed=seed, generate=generate,
                           extra_metadata={"action_source": action_source,
                                           "context_length": context_length(env)})


def load_demonstrations(path: str, *, env_config=None, context_length: int | None = None
                        ) -> Demonstrations:
    """Reads a demonstration set into device arrays (once; sample with
    `sample_demonstrations` inside a jitted step)."""
    arrays, metadata = records.read_all(path)
    _check_env_config(path, metadata, env_config)
    width = arrays["tokens"].shape[1]
    if context_length is not None and width != context_length:
        raise ValueError(f"demonstrations in {path!r} have context length {width}, the "
                         f"environment needs {context_length}")
    return Demonstrations(
        tokens=jnp.asarray(arrays["tokens"], jnp.int32),
        agent_mask=jnp.asarray(arrays["agent_mask"], jnp.float32),
        success=jnp.asarray(arrays["success"], bool),
        episode_return=jnp.asarray(arrays["episode_return"], jnp.float32),
        env_ids=jnp.asarray(arrays["env_id"], jnp.int32))


def sample_demonstrations(demos: Demonstrations, key: jax.Array, batch_size: int
                          ) -> Demonstrations:
    """A minibatch of `batch_size` episodes drawn uniformly with replacement (jittable)."""
    count = demos.tokens.shape[0]
    index = jax.random.randint(key, (batch_size,), 0, count)
    return jax.tree.map(lambda x: x[index], demos)

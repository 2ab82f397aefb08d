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

import functools
import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import struct

from arl import envs as envs_lib
from arl import rollout as rollout_lib

_VERSION = "1.0.0"


def _tfds():
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    return tfds


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


# ---------------------------------------------------------------------------- builders
@functools.lru_cache(maxsize=None)  # tfds registers builder classes by name: define once
def _builder_classes():
    """The builder classes, defined lazily so importing arl does not import tfds."""
    tfds = _tfds()

    class _Builder(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version(_VERSION)
        RELEASE_NOTES = {_VERSION: "First version."}

        def __init__(self, *, env_config=None, num_examples=0, seed=0, generate=None,
                     extra_metadata=None, **kwargs):
            self._env_config = env_config
            self._num_examples = num_examples
            self._seed = seed
            self._generate = generate
            self._extra_metadata = extra_metadata or {}
            super().__init__(**kwargs)

        def _metadata(self):
            return tfds.core.MetadataDict(
                env_config=self._env_config, num_examples=self._num_examples,
                seed=self._seed, **self._extra_metadata)

        def _split_generators(self, dl_manager):
            del dl_manager
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            return self._generate()

    class ArlTaskSet(_Builder):
        """Fixed tasks: reset key, environment id and prompt of each."""

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, description="arl evaluation task set",
                features=tfds.features.FeaturesDict({
                    "index": np.int32,
                    "reset_key": tfds.features.Tensor(
                        shape=self._extra_metadata["key_shape"], dtype=np.uint32),
                    "env_id": np.int32,
                    "prompt": tfds.features.Tensor(
                        shape=(self._extra_metadata["prompt_len"],), dtype=np.int32),
                }),
                metadata=self._metadata())

    class ArlDemonstrations(_Builder):
        """Episodes of a scripted policy: token buffers and agent masks."""

        def _info(self):
            width = self._extra_metadata["context_length"]
            return tfds.core.DatasetInfo(
                builder=self, description="arl expert demonstrations",
                features=tfds.features.FeaturesDict({
                    "index": np.int32,
                    "tokens": tfds.features.Tensor(shape=(width,), dtype=np.int32),
                    "agent_mask": tfds.features.Tensor(shape=(width,), dtype=np.uint8),
                    "length": np.int32,
                    "num_turns": np.int32,
                    "success": np.bool_,
                    "episode_return": np.float32,
                    "env_id": np.int32,
                }),
                metadata=self._metadata())

    class ArlTextTasks(_Builder):
        """Prompts and reference answers read from JSONL (`arl.data.text_tasks`): token
        ids of both, the answer text, and the answer in each verifier's canonical form
        as Unicode code points. Two splits, "train" and "eval"."""

        def _split_generators(self, dl_manager):
            del dl_manager
            return {split: self._generate(split) for split in ("train", "eval")}

        def _info(self):
            widths = self._extra_metadata["widths"]

            def ids(width):
                return tfds.features.Tensor(shape=(width,), dtype=np.int32)

            return tfds.core.DatasetInfo(
                builder=self, description="arl prompts and reference answers",
                features=tfds.features.FeaturesDict({
                    "index": np.int32,  # row within its split
                    "line": np.int32,  # 1-based line of the source JSONL file
                    "prompt": ids(widths["prompt"]),
                    "prompt_length": np.int32,
                    "prompt_text": tfds.features.Text(),
                    "answer": ids(widths["answer"]),
                    "answer_length": np.int32,
                    "answer_text": tfds.features.Text(),
                    **{f"{form}_chars": ids(widths[form]) for form in CANONICAL_FORMS},
                    **{f"{form}_length": np.int32 for form in CANONICAL_FORMS},
                }),
                metadata=self._metadata())

    return ArlTaskSet, ArlDemonstrations, ArlTextTasks


# The canonical answer forms a text-task record stores (as code points), one per verifier
# of `arl.envs.dataset_task`; length -1 means the answer has no such form (no number).
CANONICAL_FORMS = ("exact", "normalized", "number")


def _prepare(builder_cls, data_dir, **kwargs) -> str:
    tfds = _tfds()
    builder = builder_cls(data_dir=os.fspath(data_dir), file_format="array_record", **kwargs)
    if builder.is_prepared():  # tfds would silently reuse it: only if it is the same set
        on_disk = dict(tfds.builder_from_directory(os.fspath(builder.data_path)).info.metadata)
        wanted = json.loads(json.dumps(dict(builder._metadata())))  # pylint: disable=protected-access
        if on_disk != wanted:
            raise ValueError(f"{os.fspath(builder.data_path)!r} already holds a different "
                             f"dataset ({on_disk}); choose another data_dir")
        return os.fspath(builder.data_path)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(verify_ssl=False))
    return os.fspath(builder.data_path)


def _read_all(path: str, split: str = "train") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every record of `split` of the dataset at `path`, as stacked arrays in `index`
    order."""
    import grain  # pylint: disable=g-import-not-at-top

    tfds = _tfds()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no dataset directory {path!r}")
    builder = tfds.builder_from_directory(path)
    if split not in builder.info.splits:
        raise ValueError(f"dataset {path!r} has no split {split!r}; its splits are "
                         f"{sorted(builder.info.splits)}")
    source = builder.as_data_source(split=split)
    if len(source) == 0:
        raise ValueError(f"split {split!r} of dataset {path!r} is empty")
    batch = grain.MapDataset.source(source).batch(len(source))[0]
    order = np.argsort(np.asarray(batch["index"]))  # tfds shuffles records on write
    arrays = {name: np.asarray(value)[order] for name, value in batch.items()}
    return arrays, dict(builder.info.metadata or {})


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
    env_ids = np.asarray(rollout_lib.env_ids_of(timestep, num_tasks))
    prompts = np.asarray(timestep.observation.tokens)

    def generate():
        for i in range(num_tasks):
            yield i, {"index": i, "reset_key": key_data[i], "env_id": env_ids[i],
                      "prompt": prompts[i]}

    task_set_cls = _builder_classes()[0]
    return _prepare(task_set_cls, data_dir, env_config=env_config, num_examples=num_tasks,
                    seed=seed, generate=generate,
                    extra_metadata={"key_shape": list(key_data.shape[1:]),
                                    "prompt_len": int(prompts.shape[1])})


def load_task_set(path: str, *, env_config=None) -> TaskSet:
    """Reads a task set; with `env_config`, checks it was built for that environment."""
    arrays, metadata = _read_all(path)
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
    play = jax.jit(lambda key, env_params: rollout_lib.rollout(
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

    demonstrations_cls = _builder_classes()[1]
    return _prepare(demonstrations_cls, data_dir, env_config=env_config,
                    num_examples=num_episodes, seed=seed, generate=generate,
                    extra_metadata={"action_source": action_source,
                                    "context_length": rollout_lib.context_length(env)})


def load_demonstrations(path: str, *, env_config=None, context_length: int | None = None
                        ) -> Demonstrations:
    """Reads a demonstration set into device arrays (once; sample with
    `sample_demonstrations` inside a jitted step)."""
    arrays, metadata = _read_all(path)
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

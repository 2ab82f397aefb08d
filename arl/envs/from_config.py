"""Environments and their per-row params from the `config.env` section.

    env = make_env(config.env)                        # one env, or a Mixture
    params = task_params(env, config.env, member_of_task(env, num_tasks, group_size))

Every consumer (trainers, datasets, evaluation) builds its per-row params here, so an
override in `config.env.params` (or `config.env.members[i].params`) means the same
everywhere and an unknown field is rejected everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from arl.envs import registry
from arl.envs.wrappers import Mixture, broadcast_params
from arl.errors import ConfigError


def _get(section: Any, key: str, default: Any = None) -> Any:
    """`section[key]` for a ConfigDict or a plain dict; `default` when absent."""
    if section is None:
        return default
    getter = getattr(section, "get", None)
    return getter(key, default) if getter is not None else default


def make_env(env_config: Mapping[str, Any]):
    """The environment named by `env_config` (a `config.env` ConfigDict or dict): a
    registered env built with `kwargs`, or for name "mixture" a `Mixture` of `members`
    (each {"name", "kwargs", "params"})."""
    if env_config["name"] == "mixture":
        return Mixture([registry.make(m["name"], **dict(_get(m, "kwargs", {}) or {}))
                        for m in env_config["members"]])
    return registry.make(env_config["name"], **dict(_get(env_config, "kwargs", {}) or {}))


def env_names(env) -> tuple[str, ...]:
    """Display names of the environments a batch can hold: `(env.name,)`, or for a
    mixture "<index>_<member name>" per member (metric suffixes, evaluation tables)."""
    members = getattr(env, "envs", None)
    if members is None:
        return (getattr(env, "name", "env"),)
    return tuple(f"{i}_{getattr(m, 'name', 'env')}" for i, m in enumerate(members))


def override_params(params, overrides: Mapping[str, Any], field: str):
    """`params` with some fields replaced by constants of the same shape and dtype.

    Raises `ConfigError` naming `config.<field>` for a field the params do not have."""
    if not overrides:
        return params
    fields = {f.name for f in dataclasses.fields(params)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"config.{field} has unknown fields {unknown}; {type(params).__name__} fields "
            f"are {sorted(fields)}")
    return params.replace(**{k: jnp.full_like(getattr(params, k), v)
                             for k, v in overrides.items()})


def member_of_task(env, num_tasks: int, group_size: int = 1) -> jax.Array:
    """int32 [num_tasks * group_size]: the mixture member of every row (task i runs
    member i % num_members; the rows of a group share their task); zeros for one env."""
    members = env.num_envs if isinstance(env, Mixture) else 1
    return jnp.repeat(jnp.arange(num_tasks, dtype=jnp.int32) % members, group_size)


def task_params(env, env_config: Mapping[str, Any] | None, env_ids: jax.Array):
    """Per-row params `[len(env_ids)]`: the env's defaults with `env_config`'s overrides
    (`params`, or `members[i].params` for a mixture's member i); row b of a mixture
    runs member `env_ids[b]`."""
    num_rows = env_ids.shape[0]
    if isinstance(env, Mixture):
        members = _get(env_config, "members", ()) or ()
        member_params = tuple(
            override_params(member.default_params(),
                            dict(_get(members[i] if i < len(members) else None, "params",
                                      {}) or {}),
                            f"env.members[{i}].params")
            for i, member in enumerate(env.envs))
        return env.batch_params(env_ids, member_params)
    params = override_params(env.default_params(),
                             dict(_get(env_config, "params", {}) or {}), "env.params")
    return broadcast_params(params, num_rows)

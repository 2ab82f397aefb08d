"""Environments and their per-row params from the `config.env` section.

    env = make_env(config.env)                        # one env, or a Mixture
    params = task_params(env, config.env, member_of_task(env, num_tasks, group_size))

Every consumer (trainers, datasets, evaluation) builds its per-row params here, so an
override in `config.env.params` (or `config.env.members[i].params`) means the same
everywhere and an unknown field, or a value outside the env's `param_ranges()`, is
rejected everywhere, as are constructor arguments the env refuses (all as `ConfigError`s
naming the config field).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from arl.envs import registry
from arl.envs.base import ParamRange
from arl.envs.wrappers import Mixture, broadcast_params
from arl.errors import ConfigError, did_you_mean, invalid_field, one_line
from arl.text.chat_template import env_chat_format


def _get(section: Any, key: str, default: Any = None) -> Any:
    """`section[key]` for a ConfigDict or a plain dict; `default` when absent."""
    if section is None:
        return default
    getter = getattr(section, "get", None)
    return getter(key, default) if getter is not None else default


def checkpoint_codec(config) -> Any:
    """The codec of `config.model.hf_checkpoint` (its tokenizer, special tokens and chat
    template, with `config.model.system_prompt`: `HFCodec.from_pretrained`), or None
    without a checkpoint. A directory without tokenizer.json (weights only) is refused
    unless every env that takes a codec names its own in `kwargs.codec`: the model would
    otherwise read another tokenizer's ids as its own. What it refuses is a
    `ConfigError` naming the field."""
    model = _get(config, "model")
    directory = _get(model, "hf_checkpoint", "")
    if not directory:
        return None
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        needing = _envs_without_own_codec(_get(config, "env"))
        if needing:
            raise ConfigError(
                f"config.model.hf_checkpoint={directory!r} is invalid: it has no "
                f"tokenizer.json, and {', '.join(needing)} would read the model's ids "
                "with a codec of its own; copy the checkpoint's tokenizer files into it, "
                "or name the model's tokenizer in config.env.kwargs.codec (a tokenizer.json "
                "or a directory holding one).")
        return None
    system_prompt = _get(model, "system_prompt", "") or None
    kwargs = _get(model, "chat_template_kwargs", None)
    kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs or {})
    return _cached_checkpoint_codec(os.path.abspath(directory), system_prompt,
                                    json.dumps(kwargs, sort_keys=True))


def _envs_without_own_codec(env_config) -> list[str]:
    """The config fields ("env", "env.members[i]") of envs that take a codec and name
    none in their kwargs: they would be given the checkpoint's."""
    if env_config is None:
        return []
    name = _get(env_config, "name")
    if name == "mixture":
        entries = [(f"config.env.members[{i}]", m)
                   for i, m in enumerate(_get(env_config, "members", ()))]
    else:
        entries = [("config.env", env_config)]
    out = []
    for field, entry in entries:
        entry_name = _get(entry, "name")
        if not isinstance(entry_name, str) or entry_name.startswith(registry.GYMNAX_PREFIX):
            continue
        try:
            accepted, _, any_keyword = _arguments(registry.factory(entry_name))
        except ValueError:
            continue  # an unknown name: build_env reports it
        if ("codec" in accepted or any_keyword) and \
                _get(_get(entry, "kwargs", {}), "codec") is None:
            out.append(f"{field} ({entry_name!r})")
    return out


@functools.lru_cache(maxsize=8)
def _cached_checkpoint_codec(directory: str, system_prompt: str | None, kwargs_json: str):
    from arl.text.hf_codec import HFCodec  # pylint: disable=g-import-not-at-top
    try:
        return HFCodec.from_pretrained(directory, system_prompt=system_prompt,
                                       template_kwargs=json.loads(kwargs_json))
    except (ValueError, OSError) as error:
        raise ConfigError(f"config.model.hf_checkpoint={directory!r} is invalid: "
                          f"{one_line(error)}") from error


def make_env(env_config: Mapping[str, Any], codec: Any = None):
    """The environment named by `env_config` (a `config.env` ConfigDict or dict): a
    registered env built with `kwargs`, or for name "mixture" a `Mixture` of `members`
    (each {"name", "kwargs", "params"}). `codec` (e.g. `checkpoint_codec(config)`) is
    passed to every env that takes one and whose kwargs do not name their own.

    Whatever the constructors reject (an unknown or missing argument, a ValueError such
    as guess_number's `max_n` out of range) is a `ConfigError` naming
    `config.env.kwargs` (or `config.env.members[i].kwargs`) with the constructor's
    message."""
    if env_config["name"] == "mixture":
        members = [build_env(_get(m, "name"), _get(m, "kwargs", {}), f"env.members[{i}]",
                             codec)
                   for i, m in enumerate(env_config["members"])]
        try:
            return Mixture(members)
        except ValueError as error:
            raise ConfigError(f"config.env.members is invalid: {one_line(error)}") from error
    return build_env(env_config["name"], _get(env_config, "kwargs", {}), "env", codec)


def build_env(name: str, kwargs: Mapping[str, Any] | None, field: str = "env",
              codec: Any = None):
    """`registry.make(name, **kwargs)`, its rejections raised as `ConfigError`s naming
    `config.<field>.name` / `config.<field>.kwargs`; `codec` is the default of an env's
    `codec` argument (an explicit `kwargs.codec` wins)."""
    kwargs = dict(kwargs or {})
    if not isinstance(name, str):
        raise ConfigError(f"config.{field}.name={name!r} is invalid: expected an env name "
                          f"(one of {registry.registered_names()} or 'gymnax:<id>').")
    try:
        factory = registry.factory(name)
    except ValueError as error:
        raise ConfigError(f"config.{field}.name={name!r} is invalid: {one_line(error)}") \
            from error
    if name.startswith(registry.GYMNAX_PREFIX):  # make(name) passes the id; gymnax checks
        accepted, required, any_keyword = [], [], True
    else:
        accepted, required, any_keyword = _arguments(factory)
    if not any_keyword:
        for key in sorted(kwargs):
            if key not in accepted:
                raise ConfigError(
                    f"config.{field}.kwargs.{key}={kwargs[key]!r} is invalid: env {name!r} "
                    f"({_display(factory)}) takes no argument {key!r}"
                    f"{did_you_mean(key, accepted)}; its arguments are {', '.join(accepted)}.")
    if codec is not None and kwargs.get("codec") is None and (
            "codec" in accepted or (any_keyword and not name.startswith(
                registry.GYMNAX_PREFIX))):
        kwargs["codec"] = codec
    missing = [key for key in required if key not in kwargs]
    if missing:
        raise ConfigError(f"config.{field}.kwargs={kwargs!r} is invalid: env {name!r} "
                          f"({_display(factory)}) needs the arguments {missing}.")
    try:
        env = registry.make(name, **kwargs)
        chat = env_chat_format(env) if hasattr(env, "codec") else None
        if chat is not None:
            chat.check_turns(int(getattr(env, "max_turns", 1)), f"env {name!r}")
        return env
    except ConfigError:
        raise
    except (ValueError, OSError) as error:
        raise ConfigError(f"config.{field}.kwargs={kwargs!r} is invalid: env {name!r} "
                          f"refused them: {one_line(error)}") from error
    except TypeError as error:  # only where the signature could not be checked above
        if not any_keyword:
            raise
        raise ConfigError(f"config.{field}.kwargs={kwargs!r} is invalid: env {name!r} "
                          f"refused them: {one_line(error)}") from error


def _arguments(factory) -> tuple[list[str], list[str], bool]:
    """(keyword arguments `factory` accepts, those without a default, whether it takes
    **kwargs). Unknown signatures accept anything."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return [], [], True
    accepted, required, any_keyword = [], [], False
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            any_keyword = True
        elif parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                inspect.Parameter.KEYWORD_ONLY):
            accepted.append(parameter.name)
            if parameter.default is inspect.Parameter.empty:
                required.append(parameter.name)
    return accepted, required, any_keyword


def _display(factory) -> str:
    return getattr(factory, "__qualname__", None) or repr(factory)


def env_names(env) -> tuple[str, ...]:
    """Display names of the environments a batch can hold: `(env.name,)`, or for a
    mixture "<index>_<member name>" per member (metric suffixes, evaluation tables); an
    env whose rows run several tasks and report theirs in `info["env_id"]` names them in
    `member_names` (reasoning-gym's composite)."""
    members = getattr(env, "envs", None)
    if members is None:
        names = getattr(env, "member_names", None)
        if names:
            return tuple(f"{i}_{name}" for i, name in enumerate(names))
        return (getattr(env, "name", "env"),)
    return tuple(f"{i}_{getattr(m, 'name', 'env')}" for i, m in enumerate(members))


def override_params(params, overrides: Mapping[str, Any], field: str,
                    ranges: Mapping[str, ParamRange] | None = None):
    """`params` with some fields replaced by constants of the same shape and dtype.

    Raises `ConfigError` naming `config.<field>.<name>` for a field the params do not
    have, or a value that does not fit the field: the wrong kind for its dtype (a bool
    field takes True/False, an integer field integers, a float field finite numbers:
    inf and NaN are refused), a shape that does not broadcast to the field's, or a value
    outside `ranges[name]` (the env's `param_ranges()`). Only the dtype and shape of
    `params` are read, so this also works while tracing."""
    if not overrides:
        return params
    fields = [f.name for f in dataclasses.fields(params)]
    for name, value in sorted(overrides.items()):
        if name not in fields:
            raise ConfigError(
                f"config.{field}.{name}={value!r} is invalid: {type(params).__name__} has no "
                f"field {name!r}{did_you_mean(name, fields)}; its fields are {fields}.")
        _check_param_value(getattr(params, name), value, f"{field}.{name}",
                           (ranges or {}).get(name))
    # Sequences (an array field's per-element values) as arrays: full_like takes no tuple.
    return params.replace(**{
        k: jnp.full_like(getattr(params, k), np.asarray(v) if isinstance(v, (tuple, list))
                         else v)
        for k, v in overrides.items()})


def _check_param_value(default, value, field: str, allowed: ParamRange | None) -> None:
    dtype, shape = np.dtype(default.dtype), tuple(default.shape)
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        array = np.asarray(None)
    kind = array.dtype.kind
    if dtype.kind == "b":
        if kind != "b":
            raise invalid_field(field, value, "expected True or False")
    elif dtype.kind in "iu":
        if kind not in "iu":
            raise invalid_field(field, value, f"expected an integer (the field is {dtype})")
    elif dtype.kind == "f":
        if kind not in "iuf":
            raise invalid_field(field, value, "expected a number")
        if not np.all(np.isfinite(array)):
            raise invalid_field(field, value, "expected a finite number")
    try:
        fits = np.broadcast_shapes(array.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise invalid_field(field, value, f"expected a value of shape {shape}")
    if allowed is not None and not all(allowed.contains(float(x)) for x in array.flat):
        raise invalid_field(field, value, f"must be in {allowed}")


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
        ignored = dict(_get(env_config, "params", {}) or {})
        if ignored:
            raise ConfigError(f"config.env.params={ignored!r} is invalid: a mixture's params "
                              "are per member: set config.env.members[i].params.")
        members = _get(env_config, "members", ()) or ()
        member_params = tuple(
            override_params(member.default_params(),
                            dict(_get(members[i] if i < len(members) else None, "params",
                                      {}) or {}),
                            f"env.members[{i}].params", member.param_ranges())
            for i, member in enumerate(env.envs))
        return env.batch_params(env_ids, member_params)
    params = override_params(env.default_params(),
                             dict(_get(env_config, "params", {}) or {}), "env.params",
                             env.param_ranges())
    return broadcast_params(params, num_rows)

"""The schema: every key with its default (`default_config`, assembled from the
sections' modules), the check that a config holds exactly those keys, the closest valid
key for a misspelt one, and stored configs completed with the defaults of keys added
since (`with_defaults`)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import ml_collections

from arl import algorithm_table
from arl.config import advantage, env, filters, loss, model, optim, process, reward, rollout
from arl.config import reward_model
from arl.config import run, updates, vector, warm_start
from arl.config.checks import fail
from arl.config.env import FREE_FORM_SECTIONS
from arl.errors import ConfigError, closest, one_line

# The sections in the order of `default_config()`'s keys (the top-level keys first).
SECTIONS = (("env", env), ("rollout", rollout), ("model", model), ("optim", optim),
            ("updates", updates), ("advantage", advantage), ("loss", loss),
            ("warm_start", warm_start), ("vector", vector), ("process", process),
            ("filters", filters), ("reward", reward), ("reward_model", reward_model))


def default_config() -> ml_collections.ConfigDict:
    """Every key a token-environment experiment reads, with its default."""
    c = run.defaults()
    for name, section in SECTIONS:
        c[name] = section.defaults()
    return c


def with_defaults(stored: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """`default_config()` overridden by `stored` (a checkpoint's config, as a dict or a
    ConfigDict): keys added to the schema after it was written take their defaults, so
    an old checkpoint still loads. A stored key that is no longer in the schema, or a
    value of the wrong type, is a `ConfigError`."""
    stored = ml_collections.ConfigDict(dict(stored))
    _migrate_retired_keys(stored)
    check_known_keys(stored, require_all=False)
    config = default_config()
    try:
        config.update(stored)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"the stored config does not fit the schema: "
                          f"{one_line(error)}") from error
    return config


def _migrate_retired_keys(stored: ml_collections.ConfigDict) -> None:
    """A config stored before the policy loss was a key of its own: its loss-specific
    clip keys (`loss.gspo_clip_low`, ...) become `loss.clip_low` / `clip_high` when its
    algorithm trained with that loss (otherwise those held the PPO clips), and go."""
    section = stored.get("loss")
    if not isinstance(section, ml_collections.ConfigDict):
        return
    retired = [key for key in list(section.keys()) if f"loss.{key}" in loss.RETIRED_KEYS]
    if not retired:
        return
    try:
        preset = algorithm_table.get_algorithm(stored.get("algorithm", "")).policy_loss
    except ConfigError:
        preset = None  # an unregistered algorithm: reported by the checks that follow
    with section.unlocked():
        for side in ("low", "high"):
            key = f"{preset}_clip_{side}"
            if key in section:
                section[f"clip_{side}"] = section[key]
        for key in retired:
            del section[key]


def check_known_keys(config: ml_collections.ConfigDict, *, require_all: bool = True) -> None:
    """Every key of `config` must be a key of `default_config()` (a misspelt key would
    otherwise be silently ignored), except inside `FREE_FORM_SECTIONS`; every number must
    be finite; with `require_all`, every key of the schema must be present. The error
    names the closest valid key."""
    _check_section(config, default_config(), "", require_all)


def unknown_key_error(path: str, value: Any = None) -> ConfigError:
    """The `ConfigError` for `config.<path>`, which is not a config key."""
    shown = "" if value is None or isinstance(value, ml_collections.ConfigDict) \
        else f"={value!r}"
    suggestion = _closest_key(path, default_config())
    hint = f" (did you mean config.{suggestion}?)" if suggestion else ""
    return ConfigError(f"config.{path}{shown} is invalid: not a config key{hint}; every key "
                       "and its default is in arl.config.default_config().")


def check_key_path(path: str) -> None:
    """`ConfigError` unless `config.<path>` can exist: a key of the schema or a key inside
    a free-form section (`env.kwargs.<name>`, `env.params.<name>`)."""
    node, parts = default_config(), path.split(".")
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i + 1])
        if prefix in FREE_FORM_SECTIONS:
            return
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise unknown_key_error(path)
        node = node[part]


def _check_section(section, schema, prefix: str, require_all: bool) -> None:
    for key in section.keys():
        path, value = prefix + key, section[key]
        if key not in schema:
            if path in loss.RETIRED_KEYS:
                raise ConfigError(f"config.{path}={value!r} is no longer a key: set "
                                  f"config.{loss.RETIRED_KEYS[path]}.")
            while isinstance(value, ml_collections.ConfigDict) and len(value):
                inner = next(iter(value.keys()))  # name a whole leaf path: optimm.lr
                path, value = f"{path}.{inner}", value[inner]
            raise unknown_key_error(path, value)
        if path in FREE_FORM_SECTIONS:
            continue
        expected = schema[key]
        if isinstance(expected, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                fail(path, value, "expected a section of keys (a ConfigDict)")
            _check_section(value, expected, path + ".", require_all)
        else:
            _check_finite(path, value)
    missing = [key for key in schema.keys() if key not in section]
    if require_all and missing:
        raise ConfigError(f"config.{prefix}{missing[0]} is missing: build configs from "
                          "arl.config.default_config() (a stored one with "
                          "arl.config.with_defaults).")


def _check_finite(path: str, value: Any) -> None:
    """inf and NaN, alone or inside a tuple, are never a valid setting."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        fail(path, value, "expected a finite number")


def _key_paths(schema, prefix: str = "") -> list[str]:
    out = []
    for key in schema.keys():
        out.append(prefix + key)
        if isinstance(schema[key], ml_collections.ConfigDict):
            out.extend(_key_paths(schema[key], f"{prefix}{key}."))
    return out


def _closest_key(path: str, schema) -> str | None:
    """The valid key a misspelt `path` most likely meant: a close sibling
    (trian_steps -> train_steps), the same name in another section (learning_rate ->
    optim.learning_rate), or the closest whole path."""
    paths = _key_paths(schema)
    parent, _, leaf = path.rpartition(".")
    node = schema
    for part in parent.split(".") if parent else ():
        node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if isinstance(node, ml_collections.ConfigDict):
        match = closest(leaf, node.keys())
        if match:
            return f"{parent}.{match}" if parent else match
    same_name = [p for p in paths if p.rpartition(".")[2] == leaf]
    if same_name:
        return same_name[0]
    return closest(path, paths)

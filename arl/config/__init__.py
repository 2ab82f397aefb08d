"""The experiment configuration: defaults for every key, and validation before tracing.

A config is an `ml_collections.ConfigDict`. `configs/<experiment>.py` files start from
`default_config()` and override what they need; `validate(config)` rejects inconsistent
settings with a one-line error naming the field and the allowed values, before anything
is compiled: keys that are not in `default_config()` (with the closest valid key),
numbers that are not finite or out of range, names that are not registered, environment
constructor arguments and params the environment refuses, and settings the environment
cannot serve (a horizon beyond its `max_turns`, demonstrations it has no demonstrator
for). A checkpoint's stored config is read back with `with_defaults`, so keys added
since it was written take their defaults: code reads every key directly, and a key's
default lives in one place.

One module per section holds that section's defaults (with what each key means) beside
its checks: `run` (the top-level keys), `env`, `rollout`, `model`, `optim`, `updates`,
`advantage`, `loss`, `warm_start`, `vector`, `process`, `filters`, `reward`,
`reward_model`; `schema` assembles them. `off_policy` checks the asynchronous-rollout keys of `rollout` and `loss` together.

`config.imports` names modules imported first (by `validate` and by everything that
builds from a config), so environments and algorithms registered by a user's own module
work in configs, on resume and in `experiments.evaluate`: the key is stored with every
checkpoint's config.
"""

from __future__ import annotations

import collections

import ml_collections

from arl import algorithm_table
from arl.config import advantage as advantage_section
from arl.config import env as env_section
from arl.config import filters as filters_section
from arl.config import loss as loss_section
from arl.config import model as model_section
from arl.config import off_policy as off_policy_section
from arl.config import optim as optim_section
from arl.config import process as process_section
from arl.config import reward as reward_section
from arl.config import reward_model as reward_model_section
from arl.config import rollout as rollout_section
from arl.config import run as run_section
from arl.config import updates as updates_section
from arl.config import vector as vector_section
from arl.config import warm_start as warm_start_section
from arl.config.env import FREE_FORM_SECTIONS
from arl.config.model import FLOAT_DTYPES
from arl.config.off_policy import uses_two_programs
from arl.config.run import import_modules
from arl.config.schema import (check_key_path, check_known_keys, default_config,
                               unknown_key_error, with_defaults)
from arl.config.updates import MINIBATCH_SHUFFLES, reuses_rollout_activations
from arl.errors import ConfigError

__all__ = ["ConfigError", "FLOAT_DTYPES", "FREE_FORM_SECTIONS", "MINIBATCH_SHUFFLES",
           "check_key_path", "check_known_keys", "default_config", "import_modules",
           "reuses_rollout_activations", "unknown_key_error", "uses_two_programs",
           "validate", "with_defaults"]


# The configs validated in this process, by content: the CLI, `experiment.run` and the
# trainer each validate what they are given (each is an entry point), and a config
# already checked is not checked again (its environment is not built again either).
_VALIDATED: collections.OrderedDict = collections.OrderedDict()
_VALIDATED_KEPT = 32


def _validation_key(config: ml_collections.ConfigDict, num_devices: int | None):
    """What the checks read: the config's content, the device count and the algorithm row
    (a re-registered name is checked again). None: not memoizable (no JSON form)."""
    try:
        text = config.to_json_best_effort(sort_keys=True)
        row = algorithm_table.get_algorithm(config.algorithm)
    except Exception:  # pylint: disable=broad-except  # a malformed config: check it
        return None
    return text, num_devices, id(row)


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None,
             workdir: str | None = None) -> None:
    """Rejects inconsistent settings with a `ConfigError` naming the field.

    Imports `config.imports` first (so the names they register are valid). Builds the
    token environment (cheap, no compilation) to check its constructor arguments,
    params overrides, `max_turns` and scripted policies against the config. A config
    that passed with the same content and `num_devices` earlier in the process is not
    checked again (`workdir`, when given, always is)."""
    key = _validation_key(config, num_devices)
    if key is None or key not in _VALIDATED:
        _check(config, num_devices)
        if key is not None:
            _VALIDATED[key] = None
            while len(_VALIDATED) > _VALIDATED_KEPT:
                _VALIDATED.popitem(last=False)
    if workdir is not None:
        run_section.validate_workdir(workdir)


def _check(config: ml_collections.ConfigDict, num_devices: int | None) -> None:
    import_modules(config)
    check_known_keys(config)
    algorithm = algorithm_table.get_algorithm(config.algorithm)
    run_section.validate(config, num_devices)
    optim_section.validate(config)
    loss_section.validate(config)
    warm_start_section.validate(config, algorithm)
    advantage_section.validate(config)
    filters_section.validate(config)
    updates_section.validate(config)
    off_policy_section.validate(config, num_devices, algorithm)
    updates_section.validate_reuse(config)
    if algorithm.trainer == "vector":
        vector_section.validate(config)
    else:
        rollout_section.validate(config, algorithm)
        model_section.validate(config)
        env_section.validate(config)
        process_section.validate(config)
        reward_section.validate(config)
        reward_model_section.validate(config)
        if algorithm.validate is not None:
            algorithm.validate(config)

"""Environment names: `make(name, **kwargs)` builds a registered environment;
"gymnax:<id>" wraps a gymnax environment (gymnax is needed by that adapter only);
"<module>:<attribute>" (e.g. "my_tools:Collatz") imports `module` and builds its
`attribute`, so an environment in the user's own code works in a config, and in every
process that reads the config (training, resuming, `experiments.evaluate`), without a
`register` call."""

from __future__ import annotations

import importlib
import re
from typing import Callable

from arl.envs.bandit import Bandit
from arl.envs.base import Environment
from arl.envs.calculator import Calculator
from arl.envs.code_interpreter import CodeInterpreter
from arl.envs.countdown import Countdown
from arl.envs.frozen_lake import FrozenLake
from arl.envs.guess_number import GuessNumber
from arl.envs.sokoban import Sokoban
from arl.envs.sql_query import SqlQuery

GYMNAX_PREFIX = "gymnax:"
_IMPORT_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

_REGISTRY: dict[str, Callable[..., Environment]] = {
    "guess_number": GuessNumber,
    "calculator": Calculator,
    "frozen_lake": FrozenLake,
    "bandit": Bandit,
    "sokoban": Sokoban,
    "countdown": Countdown,
    # Host environments (arl.envs.host): Python tools behind a host callback.
    "code_interpreter": CodeInterpreter,
    "sql": SqlQuery,
}


def register(name: str, factory: Callable[..., Environment]) -> None:
    """Makes `name` work in `make` and in configs (`config.env.name`, mixture members).

    Registering the same factory again is a no-op (a module imported twice, a notebook
    cell run twice); another factory under a taken name is an error."""
    if not isinstance(name, str) or not name or name == "mixture" or name.startswith(
            GYMNAX_PREFIX):
        raise ValueError(f"env name {name!r} is reserved or empty; pick another name")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not factory and not _same_class(existing,
                                                                            factory):
        raise ValueError(f"env name {name!r} is already registered to {existing!r}")
    _REGISTRY[name] = factory


def _same_class(a, b) -> bool:
    """The same class defined again (e.g. a re-imported module): same module and name."""
    return (isinstance(a, type) and isinstance(b, type) and a.__module__ == b.__module__
            and a.__qualname__ == b.__qualname__)


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def is_import_name(name) -> bool:
    """Whether `name` has the form "<module>:<attribute>" (and is not a gymnax id)."""
    return (isinstance(name, str) and not name.startswith(GYMNAX_PREFIX)
            and _IMPORT_NAME.match(name) is not None)


def import_factory(name: str) -> Callable[..., Environment]:
    """The callable named by "<module>:<attribute>" (a dotted attribute path allowed).

    Raises ValueError naming `name` when the module cannot be imported or has no such
    attribute, or the attribute is not callable."""
    module_name, _, attribute = name.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"env name {name!r}: cannot import module {module_name!r} "
                         f"({exc})") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"env name {name!r}: module {module_name!r} has no attribute "
                             f"{attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"env name {name!r}: {attribute!r} is not callable")
    return target


def make(name: str, **kwargs) -> Environment:
    """Build environment `name` (see `registered_names()`, "gymnax:<gymnax id>" or
    "<module>:<attribute>").

    A string `codec` kwarg is the path of a Hugging Face `tokenizer.json`, wrapped in
    `arl.envs.hf_codec.HFCodec` (so a config can name a tokenizer as plain data).
    """
    if isinstance(kwargs.get("codec"), str):
        from arl.envs.hf_codec import HFCodec  # pylint: disable=g-import-not-at-top
        kwargs["codec"] = HFCodec(kwargs["codec"])
    if name.startswith(GYMNAX_PREFIX):
        # gymnax is imported only when a gymnax env is asked for.
        from arl.envs.gymnax_adapter import GymnaxEnvironment  # pylint: disable=g-import-not-at-top
        return GymnaxEnvironment(name[len(GYMNAX_PREFIX):], **kwargs)
    if name not in _REGISTRY and is_import_name(name):
        return import_factory(name)(**kwargs)
    if name not in _REGISTRY:
        raise ValueError(f"unknown env name {name!r}; known names: {registered_names()}, "
                         "'gymnax:<id>' (e.g. 'gymnax:CartPole-v1') or '<module>:<class>'")
    return _REGISTRY[name](**kwargs)

"""Environment names: `make(name, **kwargs)` builds a registered environment;
"gymnax:<id>" wraps a gymnax environment (gymnax is needed by that adapter only)."""

from __future__ import annotations

from typing import Callable

from arl.envs.tasks.bandit import Bandit
from arl.envs.base import Environment
from arl.envs.tasks.calculator import Calculator
from arl.envs.tasks.code_interpreter import CodeInterpreter
from arl.envs.tasks.countdown import Countdown
from arl.envs.tasks.dataset_task import DatasetTask
from arl.envs.tasks.frozen_lake import FrozenLake
from arl.envs.tasks.guess_number import GuessNumber
from arl.envs.tasks import reasoning_gym_task
from arl.envs.tasks import openenv_client
from arl.envs.tasks import textarena_game
from arl.envs.tasks.sokoban import Sokoban
from arl.envs.tasks.sql_query import SqlQuery

GYMNAX_PREFIX = "gymnax:"

_REGISTRY: dict[str, Callable[..., Environment]] = {
    "guess_number": GuessNumber,
    "calculator": Calculator,
    "dataset_task": DatasetTask,
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


# "<prefix>:<name>" environments of other libraries (`register_prefix`): prefix -> a
# function of the name after the colon returning the factory (imports the library).
_PREFIXES: dict[str, Callable[[str], Callable[..., Environment]]] = {}


def register_prefix(prefix: str, loader: Callable[[str], Callable[..., Environment]]) -> None:
    """Makes "<prefix>:<name>" work in `make` and in configs: `loader(name)` returns the
    factory (e.g. `functools.partial(AdapterClass, name)`), importing its library only
    when such a name is asked for."""
    if not isinstance(prefix, str) or not prefix.isidentifier() or prefix == "gymnax":
        raise ValueError(f"env name prefix {prefix!r} is reserved or not an identifier")
    _PREFIXES[prefix] = loader


def prefixed(name: str):
    """(prefix, rest) of a registered "<prefix>:<rest>" name, else None."""
    prefix, colon, rest = str(name).partition(":")
    return (prefix, rest) if colon and prefix in _PREFIXES else None


# Other libraries' environments (each imports its library on first use).
register_prefix("reasoning_gym", reasoning_gym_task.factory)
register_prefix("textarena", textarena_game.factory)
register_prefix("openenv", openenv_client.factory)


def registered_prefixes() -> list[str]:
    """"<prefix>:<name>" forms of the registered prefixes, for error messages."""
    return [f"{prefix}:<name>" for prefix in sorted(_PREFIXES)]


def is_known(name: str) -> bool:
    """Whether `name` is registered or has a registered prefix (a token env name)."""
    return name in _REGISTRY or prefixed(name) is not None


def _same_class(a, b) -> bool:
    """The same class defined again (e.g. a re-imported module): same module and name."""
    return (isinstance(a, type) and isinstance(b, type) and a.__module__ == b.__module__
            and a.__qualname__ == b.__qualname__)


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def factory(name: str) -> Callable[..., Environment]:
    """What `make(name, ...)` calls: the registered class or function, or for
    "gymnax:<id>" the gymnax adapter class."""
    if name.startswith(GYMNAX_PREFIX):
        from arl.envs.gymnax_adapter import GymnaxEnvironment  # pylint: disable=g-import-not-at-top
        return GymnaxEnvironment
    if prefixed(name) is not None:
        prefix, rest = prefixed(name)
        return _PREFIXES[prefix](rest)
    if name not in _REGISTRY:
        raise ValueError(f"unknown env name {name!r}; known names: {registered_names()} "
                         "or 'gymnax:<id>' (e.g. 'gymnax:CartPole-v1')")
    return _REGISTRY[name]


def make(name: str, **kwargs) -> Environment:
    """Build environment `name` (see `registered_names()`, or "gymnax:<gymnax id>").

    A string `codec` kwarg is the path of a Hugging Face `tokenizer.json`, wrapped in
    `arl.text.hf_codec.HFCodec` (so a config can name a tokenizer as plain data), or of
    a checkpoint directory (`HFCodec.from_pretrained`: its special tokens and chat
    template).
    """
    if isinstance(kwargs.get("codec"), str):
        import os  # pylint: disable=g-import-not-at-top

        from arl.text.hf_codec import HFCodec  # pylint: disable=g-import-not-at-top
        path = kwargs["codec"]
        kwargs["codec"] = (HFCodec.from_pretrained(path) if os.path.isdir(path)
                           else HFCodec(path))
    if name.startswith(GYMNAX_PREFIX):
        # gymnax is imported only when a gymnax env is asked for.
        from arl.envs.gymnax_adapter import GymnaxEnvironment  # pylint: disable=g-import-not-at-top
        return GymnaxEnvironment(name[len(GYMNAX_PREFIX):], **kwargs)
    if prefixed(name) is not None:
        return factory(name)(**kwargs)
    if name not in _REGISTRY:
        raise ValueError(f"unknown env name {name!r}; known names: {registered_names()} "
                         "or 'gymnax:<id>' (e.g. 'gymnax:CartPole-v1')")
    return _REGISTRY[name](**kwargs)

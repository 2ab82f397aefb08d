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
    if name not in _REGISTRY:
        raise ValueError(f"unknown env name {name!r}; known names: {registered_names()} "
                         "or 'gymnax:<id>' (e.g. 'gymnax:CartPole-v1')")
    return _REGISTRY[name](**kwargs)

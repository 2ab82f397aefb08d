"""Jittable environments: the contract, token environments, wrappers, gymnax adapter.

`make(name, **kwargs)` builds a registered environment; "gymnax:<id>" wraps a gymnax
environment (gymnax is an optional dependency of that adapter only).
"""

from __future__ import annotations

from typing import Callable

from arl.envs.bandit import Bandit, BanditParams, BanditState
from arl.envs.base import (Box, Discrete, Environment, TimeStep, TokenChunk, TokenEnvironment,
                           TokenEnvState, TokenSpace)
from arl.envs.calculator import Calculator, CalculatorParams, CalculatorState
from arl.envs.codec import CharCodec, Codec
from arl.envs.countdown import Countdown, CountdownParams, CountdownState
from arl.envs.frozen_lake import FrozenLake, FrozenLakeParams, FrozenLakeState
from arl.envs.guess_number import GuessNumber, GuessNumberParams, GuessNumberState
from arl.envs.sokoban import Sokoban, SokobanParams, SokobanState
from arl.envs.wrappers import (AutoReset, Mixture, MixtureParams, MixtureState, TurnHorizon,
                               TurnHorizonParams, TurnHorizonState, VmapWrapper, batch,
                               broadcast_params)

_REGISTRY: dict[str, Callable[..., Environment]] = {
    "guess_number": GuessNumber,
    "calculator": Calculator,
    "frozen_lake": FrozenLake,
    "bandit": Bandit,
    "sokoban": Sokoban,
    "countdown": Countdown,
}


def register(name: str, factory: Callable[..., Environment]) -> None:
    if name in _REGISTRY or name.startswith("gymnax:"):
        raise ValueError(f"name {name!r} is already registered or reserved")
    _REGISTRY[name] = factory


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def make(name: str, **kwargs) -> Environment:
    """Build environment `name` (see `registered_names()`, or "gymnax:<gymnax id>").

    A string `codec` kwarg is the path of a Hugging Face `tokenizer.json`, wrapped in
    `arl.envs.hf_codec.HFCodec` (so a config can name a tokenizer as plain data).
    """
    if isinstance(kwargs.get("codec"), str):
        from arl.envs.hf_codec import HFCodec
        kwargs["codec"] = HFCodec(kwargs["codec"])
    if name.startswith("gymnax:"):
        from arl.envs.gymnax_adapter import GymnaxEnvironment
        return GymnaxEnvironment(name[len("gymnax:"):], **kwargs)
    if name not in _REGISTRY:
        raise ValueError(f"unknown env name {name!r}; known names: {registered_names()} "
                         "or 'gymnax:<id>' (e.g. 'gymnax:CartPole-v1')")
    return _REGISTRY[name](**kwargs)


__all__ = [
    "AutoReset", "Bandit", "BanditParams", "BanditState", "Box", "Calculator",
    "CalculatorParams", "CalculatorState", "CharCodec", "Codec", "Countdown",
    "CountdownParams", "CountdownState", "Discrete", "Environment", "FrozenLake",
    "FrozenLakeParams", "FrozenLakeState", "GuessNumber", "GuessNumberParams",
    "GuessNumberState", "Mixture", "MixtureParams", "MixtureState", "Sokoban", "SokobanParams",
    "SokobanState", "TimeStep", "TokenChunk", "TokenEnvState", "TokenEnvironment", "TokenSpace",
    "TurnHorizon", "TurnHorizonParams", "TurnHorizonState", "VmapWrapper", "batch",
    "broadcast_params", "make", "register", "registered_names",
]

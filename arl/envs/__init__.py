"""Jittable environments: the contract, wrappers, host environments, gymnax adapter, and
the concrete tasks (`arl.envs.tasks`).

`make(name, **kwargs)` builds a registered environment; "gymnax:<id>" wraps a gymnax
environment (gymnax is an optional dependency of that adapter only). `make_env` and
`task_params` build an environment and its per-row params from `config.env`.
"""

from __future__ import annotations

from arl.envs import tasks
from arl.envs.base import (Box, Discrete, Environment, TimeStep, TokenChunk, TokenEnvironment,
                           TokenEnvState, TokenSpace)
from arl.text.codec import CharCodec, Codec
from arl.envs.from_config import (checkpoint_codec, env_names, make_env, member_of_task,
                                  task_params)
from arl.envs.host import (HostEnvironment, HostEnvState, HostEpisode, HostStats, HostTurn,
                           is_host_environment)
from arl.envs.registry import make, register, registered_names
from arl.envs.tasks.bandit import Bandit, BanditParams, BanditState
from arl.envs.tasks.calculator import Calculator, CalculatorParams, CalculatorState
from arl.envs.tasks.code_interpreter import CodeInterpreter
from arl.envs.tasks.countdown import Countdown, CountdownParams, CountdownState
from arl.envs.tasks.dataset_task import DatasetTask, DatasetTaskParams, DatasetTaskState
from arl.envs.tasks.frozen_lake import FrozenLake, FrozenLakeParams, FrozenLakeState
from arl.envs.tasks.guess_number import GuessNumber, GuessNumberParams, GuessNumberState
from arl.envs.tasks.sokoban import Sokoban, SokobanParams, SokobanState
from arl.envs.tasks.sql_query import SqlQuery
from arl.envs.tool_use import ToolEnvironment, ToolParams, ToolTask
from arl.envs.wrappers import (AutoReset, Mixture, MixtureParams, MixtureState, TurnHorizon,
                               TurnHorizonParams, TurnHorizonState, VmapWrapper, batch,
                               broadcast_params)

__all__ = [
    "AutoReset", "Bandit", "BanditParams", "BanditState", "Box", "Calculator",
    "CalculatorParams", "CalculatorState", "CharCodec", "CodeInterpreter", "Codec", "Countdown",
    "CountdownParams", "CountdownState", "DatasetTask", "DatasetTaskParams", "DatasetTaskState",
    "Discrete", "Environment", "FrozenLake", "FrozenLakeParams", "FrozenLakeState",
    "GuessNumber", "GuessNumberParams", "GuessNumberState", "HostEnvState", "HostEnvironment",
    "HostEpisode", "HostStats", "HostTurn", "Mixture", "MixtureParams", "MixtureState",
    "Sokoban", "SokobanParams", "SokobanState", "SqlQuery", "TimeStep", "TokenChunk",
    "TokenEnvState", "TokenEnvironment", "TokenSpace", "ToolEnvironment", "ToolParams",
    "ToolTask", "TurnHorizon", "TurnHorizonParams", "TurnHorizonState", "VmapWrapper", "batch",
    "broadcast_params", "checkpoint_codec", "env_names", "is_host_environment", "make", "make_env",
    "member_of_task", "register", "registered_names", "task_params",
]

"""The concrete tasks shipped with `arl`, each one module and one registered name (see
`arl.envs.registered_names()`): in-graph token environments (`bandit`, `calculator`,
`countdown`, `dataset_task`, `frozen_lake`, `guess_number`, `sokoban`) and host
environments with a Python tool (`code_interpreter`, `sql`: `sql_query`). The contract
they implement and the machinery they share are in `arl.envs`; `arithmetic` is the
expression parser and rational arithmetic `calculator` and `countdown` share (no task of
its own)."""

from __future__ import annotations

from arl.envs.tasks import (bandit, calculator, code_interpreter, countdown, dataset_task,
                            frozen_lake, guess_number, sokoban, sql_query)

MODULES = ("bandit", "calculator", "code_interpreter", "countdown", "dataset_task",
           "frozen_lake", "guess_number", "sokoban", "sql_query")  # one task each

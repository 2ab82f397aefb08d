"""In-graph trainers: each turns a config into a compiled `train_step(state)`.

    trainer = build(config)          # the trainer the config describes (see `build`)
    state = trainer.init_state()
    state, metrics = trainer.train_step(state)
"""

from __future__ import annotations

import ml_collections

from arl import algorithm_table
from arl import config as config_lib
from arl.trainers import placement
from arl.trainers.policy import Policy, TokenScores
from arl.trainers.protocol import EvaluationReport, Trainer
from arl.trainers.state import StateLayout, TrainState
from arl.trainers.per_turn import PerTurnTrainer
from arl.trainers.token import TokenTrainer
from arl.trainers.two_program import TwoProgramState, TwoProgramTrainer
from arl.trainers.update import Learner, UpdateBatch
from arl.trainers.vector_ppo import VectorPPO, VectorTrainState


def build(config: ml_collections.ConfigDict, *, mesh=None,
          two_programs: bool | None = None) -> Trainer:
    """The trainer `config` describes; the one place that decides it (the API, the CLI,
    `arl.runs.experiment.run`, evaluation and export all build through here):

    * `VectorPPO` when the algorithm's row trains vector environments;
    * else a `TokenTrainer` (a `PerTurnTrainer` for `rollout.history="per_turn"`) on
      `mesh` (default: the training mesh of `arl.trainers.placement.training_mesh`, the
      first prod(config.mesh) devices), run as one fused program, or
    * a `TwoProgramTrainer` over it (rollout and update as two overlapped programs, the
      rollout on `config.rollout.mesh`) when the config has a policy lag or a rollout
      mesh (`arl.config.uses_two_programs`). Its state is a `TwoProgramState`.

    `two_programs` overrides that choice (None: by the config); evaluation uses it to
    read a two-program run's checkpoint on fewer devices than the run had."""
    if algorithm_table.get_algorithm(config.algorithm).trainer == "vector":
        return VectorPPO(config)
    if mesh is None:
        mesh = placement.training_mesh(config)  # None: the trainer's default
    per_turn = config.rollout.history == "per_turn"
    trainer = (PerTurnTrainer if per_turn else TokenTrainer)(config, mesh=mesh)
    if two_programs is None:
        two_programs = config_lib.uses_two_programs(config)
    return TwoProgramTrainer(trainer) if two_programs else trainer


__all__ = [
    "EvaluationReport", "Learner", "PerTurnTrainer", "Policy", "StateLayout", "TokenScores",
    "TokenTrainer", "TrainState", "Trainer", "TwoProgramState", "TwoProgramTrainer", "UpdateBatch",
    "VectorPPO", "VectorTrainState", "build",
]

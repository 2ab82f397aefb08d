"""In-graph trainers: each turns a config into one compiled `train_step(state)`.

    trainer = build(config)          # TokenTrainer or VectorPPO, by the algorithm's row
    state = trainer.init_state()
    state, metrics = trainer.train_step(state)
"""

from __future__ import annotations

import ml_collections

from arl import algorithm_table
from arl.trainers.policy import Policy, TokenScores
from arl.trainers.protocol import EvaluationReport, Trainer
from arl.trainers.state import StateLayout, TrainState
from arl.trainers.token import TokenTrainer
from arl.trainers.update import Learner, UpdateBatch
from arl.trainers.vector_ppo import VectorPPO, VectorTrainState


def build(config: ml_collections.ConfigDict, *, mesh=None) -> Trainer:
    """The trainer that runs `config.algorithm` (its row's `trainer`)."""
    if algorithm_table.get_algorithm(config.algorithm).trainer == "vector":
        return VectorPPO(config)
    return TokenTrainer(config, mesh=mesh)


__all__ = [
    "EvaluationReport", "Learner", "Policy", "StateLayout", "TokenScores", "TokenTrainer",
    "TrainState", "Trainer", "UpdateBatch", "VectorPPO", "VectorTrainState", "build",
]

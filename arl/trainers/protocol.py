"""What the experiment loop (`arl.runs.experiment`) needs from a trainer.

Three trainers implement it: `TokenTrainer` (multi-turn token environments), `VectorPPO`
(vector environments), and `arl.trainers.two_program.TwoProgramTrainer` (a `TokenTrainer`'s
step as a rollout and an update program, overlapped at a policy lag; its state also holds
the behaviour parameters of the rollouts in flight). The experiment loop never looks at
which one it has: whatever `init_state` returns is what it checkpoints, restores (with
`abstract_state` as the target) and passes back to `train_step`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import ml_collections
from flax import struct


@struct.dataclass
class EvaluationReport:
    """What a periodic evaluation logs: metrics (`eval/...`) and a transcript to save
    under `samples/` (None when the environment has no text)."""

    metrics: dict[str, Any]
    transcript: str | None = struct.field(pytree_node=False, default=None)


class Trainer(Protocol):
    config: ml_collections.ConfigDict
    # One step: a compiled program (two for TwoProgramTrainer); the state is donated.
    train_step: Callable[[Any], tuple[Any, dict[str, jax.Array]]]

    def init_state(self, seed: int | None = None) -> Any:
        """The state before training (sharded on the trainer's mesh)."""

    def abstract_state(self) -> Any:
        """Shapes, dtypes and shardings of the state: the checkpoint restore target."""

    def warm_start(self, state: Any, *, log: Callable[[str], Any]) -> Any:
        """The RL start state of a fresh run (`config.warm_start`); `state` itself when
        the config asks for none."""

    def evaluation_report(self, state: Any, key: jax.Array) -> EvaluationReport:
        """A greedy evaluation of the current policy on fresh tasks (and samples)."""

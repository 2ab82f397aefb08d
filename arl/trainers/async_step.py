"""Asynchronous rollouts: the token trainer's step as two programs, overlapped.

    two = TwoProgramTrainer(trainer)                  # a TokenTrainer; lag and mesh from
    for state, metrics in two.steps(state, 100):      # config.rollout.policy_lag / .mesh
        ...

* `rollout(behaviour_params, state_key, step) -> Trajectory` on the rollout mesh:
  `TokenTrainer.rollout` with the keys and horizon the fused step would draw at `step`.
* `update(state, trajectory, behaviour_version) -> (state, metrics)` on the training mesh:
  `TokenTrainer.learn`, the fused step's signals + update, donating the state.

Parameters move training -> rollout mesh and trajectories rollout -> training mesh onto
the other mesh's `NamedSharding`s (`placement.move`: `jax.device_put` in one process,
shard copies inside each process across several; `arl.trainers.placement` also says
where the meshes lie). The host loop (`steps`) dispatches
rollout t+1 before update t and never waits on either: JAX dispatch is asynchronous, so
the two run concurrently wherever they can (disjoint devices; a host tool's wall time).
Rollout t samples with the parameters after max(t - k, 0) updates (k =
`policy_lag`); the loop keeps those k versions as copies on the rollout mesh, each taken
right after the update that made it, before the next update donates the state.

With k = 0 the loop dispatches update t before rollout t + 1 (which needs its result):
the synchronous two-program run, the same numbers as the fused step up to float rounding
(two programs partition differently). Monte Carlo branching and the reuse of rollout
activations need the fused step (`arl.config` refuses them here).
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp

from flax import struct

from arl import config as config_lib
from arl import sharding as sharding_lib
from arl.models import transformer as transformer_lib
from arl.rollout import Trajectory
from arl.trainers import placement
from arl.trainers.state import TrainState


@struct.dataclass
class AsyncCheckpoint:
    """What a resume at lag k needs: the state after step t, and the behaviour
    parameters rollouts t .. t+k-1 read (versions max(s - k, 0)); their trajectories are
    recomputed from these, bit for bit (same programs, parameters and keys)."""

    state: TrainState
    behaviour: tuple  # k parameter trees, on the rollout mesh


def build(trainer) -> "TwoProgramTrainer | None":
    """The two-program trainer of `trainer`'s config (`config.rollout.policy_lag` or a
    `config.rollout.mesh`), or None for the fused step."""
    if not config_lib.uses_two_programs(trainer.config):
        return None
    return TwoProgramTrainer(trainer)


def abstract_checkpoint(trainer, param_shardings, policy_lag: int) -> AsyncCheckpoint:
    """The restore target of a two-program run's checkpoint, with the behaviour
    parameters on `param_shardings` (the rollout mesh's, or any other: orbax reshards)."""
    state = trainer.abstract_state()
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(trainer.layout.policy_params, state), param_shardings)
    return AsyncCheckpoint(state=state, behaviour=(params,) * policy_lag)


class TwoProgramTrainer:
    """A `TokenTrainer`'s step split into a rollout and an update program, and the host
    loop that overlaps them at a bounded policy lag."""

    def __init__(self, trainer, *, policy_lag: int | None = None, mesh=None):
        c = trainer.config
        if trainer.branch_turns or trainer.learner.reuse_activations:
            raise ValueError("TwoProgramTrainer: Monte Carlo branching and "
                             "updates.reuse_rollout_activations need the fused step")
        self.trainer = trainer
        self.policy_lag = c.rollout.policy_lag if policy_lag is None else policy_lag
        if self.policy_lag < 0:
            raise ValueError(f"TwoProgramTrainer: policy_lag must be >= 0, got "
                             f"{self.policy_lag}")
        self.mesh = placement.rollout_mesh(c, trainer.mesh) if mesh is None else mesh
        abstract_params = transformer_lib.abstract_params(trainer.model)
        self.param_shardings = transformer_lib.param_shardings(abstract_params, self.mesh)
        self.trajectory_shardings = sharding_lib.batch_sharding(self.mesh)
        self.training_trajectory_shardings = sharding_lib.batch_sharding(trainer.mesh)
        if jax.process_count() > 1:  # every move stays inside a process (placement.py)
            for leaf, source, target in zip(
                    jax.tree.leaves(abstract_params),
                    jax.tree.leaves(trainer.layout.param_shardings),
                    jax.tree.leaves(self.param_shardings)):
                placement.check_local("rollout.mesh", tuple(c.rollout.mesh), source, target,
                                      leaf.shape, "the parameters")
            placement.check_local("rollout.mesh", tuple(c.rollout.mesh),
                                  self.trajectory_shardings,
                                  self.training_trajectory_shardings,
                                  (trainer.batch_size,), "the trajectory rows")
        replicated = sharding_lib.replicated(self.mesh)
        self._replicated = replicated
        self.rollout = jax.jit(self._rollout, out_shardings=self.trajectory_shardings)
        state_shardings = trainer.state_shardings()
        self.update = jax.jit(
            self._update,
            in_shardings=(state_shardings, self.training_trajectory_shardings,
                          sharding_lib.replicated(trainer.mesh)),
            out_shardings=(state_shardings, sharding_lib.replicated(trainer.mesh)),
            donate_argnums=(0,))
        self._next_key = jax.jit(lambda key: trainer.step_keys(key).next,
                                 out_shardings=replicated)
        self._policy_params = jax.jit(trainer.layout.policy_params,
                                      out_shardings=trainer.layout.param_shardings)
        # The rollout mesh for the model's activation constraints, where the trainer
        # has them on its own mesh (config.activation_sharding).
        self._activation_mesh = self.mesh if trainer.activation_mesh is not None else None

    # ------------------------------------------------------------------ programs
    def _rollout(self, behaviour_params, state_key, step) -> Trajectory:
        """Rollout of step `step` (whose `TrainState.key` is `state_key`) with
        `behaviour_params`: the fused step's rollout, keys and horizon."""
        keys = self.trainer.step_keys(state_key)
        with sharding_lib.activation_mesh(self._activation_mesh):
            return self.trainer.rollout(behaviour_params, keys.rollout,
                                        self.trainer.horizon(step))

    def _update(self, state: TrainState, traj: Trajectory, behaviour_version):
        """Signals + update of `traj`, sampled by the parameters after
        `behaviour_version` updates; adds `off_policy/staleness` (state.step - that)."""
        keys = self.trainer.step_keys(state.key)
        with sharding_lib.activation_mesh(self.trainer.activation_mesh):
            new_state, metrics = self.trainer.learn(state, traj, keys,
                                                    self.trainer.horizon(state.step))
        metrics["off_policy/staleness"] = (state.step - behaviour_version).astype(jnp.float32)
        return new_state, metrics

    # ------------------------------------------------------------------ transfers
    def behaviour_params(self, state: TrainState) -> Any:
        """A copy of the policy's parameters in `state` on the rollout mesh: its own
        buffers, which outlive the next update's donation of `state`."""
        params = state.params
        if self.trainer.lora is not None:  # merged: new arrays already
            params = self._policy_params(state)
        return placement.move(params, self.param_shardings)

    def to_training(self, traj: Trajectory) -> Trajectory:
        """`traj` resharded onto the training mesh (rows over its data x fsdp)."""
        return placement.move(traj, self.training_trajectory_shardings)

    def state_key(self, state: TrainState) -> jax.Array:
        """A copy of `state.key` on the rollout mesh."""
        return placement.move(state.key, self._replicated)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, state: TrainState, history: dict[int, Any]) -> AsyncCheckpoint:
        """`state` and the behaviour versions its next `policy_lag` rollouts read, from
        `history` (kept up to date by `steps`)."""
        step = int(state.step)
        return AsyncCheckpoint(state=state, behaviour=tuple(
            history[self.behaviour_version(s)] if self.behaviour_version(s) in history
            else self.behaviour_params(state) for s in range(step, step + self.policy_lag)))

    def abstract_checkpoint(self) -> AsyncCheckpoint:
        """Shapes, dtypes and shardings of `checkpoint` (orbax restore target)."""
        return abstract_checkpoint(self.trainer, self.param_shardings, self.policy_lag)

    def restored(self, checkpoint: AsyncCheckpoint) -> tuple[TrainState, dict[int, Any]]:
        """(state, history) to resume `steps` from."""
        step = int(checkpoint.state.step)
        history = {self.behaviour_version(s): params for s, params in
                   zip(range(step, step + self.policy_lag), checkpoint.behaviour)}
        return checkpoint.state, history

    # ------------------------------------------------------------------ host loop
    def behaviour_version(self, step: int) -> int:
        """The parameter version (updates applied) rollout `step` samples with."""
        return max(step - self.policy_lag, 0)

    def steps(self, state: TrainState, num_steps: int, *,
              history: dict[int, Any] | None = None) -> Iterator[tuple[TrainState, dict]]:
        """Runs `num_steps` steps from `state`, yielding (state, metrics) after each
        update is dispatched (nothing is fetched: the caller decides when to read).

        `history`: behaviour parameters by version (`behaviour_params`) older than
        `state`, which the first `policy_lag` rollouts of a resumed run need; the loop
        adds to it and drops what no later rollout reads. Raises ValueError when a
        needed version is missing."""
        start = int(state.step)
        end = start + num_steps
        k = self.policy_lag
        versions = dict(history or {})
        versions[start] = self.behaviour_params(state)
        missing = sorted({self.behaviour_version(t) for t in range(start, min(end, start + k))}
                         - set(versions))
        if missing:
            raise ValueError(f"TwoProgramTrainer.steps: resuming at step {start} with "
                             f"policy_lag={k} needs the behaviour parameters of versions "
                             f"{missing} (pass them as history)")
        key = self.state_key(state)
        pending = {}

        def dispatch_rollout(t):
            nonlocal key
            version = self.behaviour_version(t)
            pending[t] = (self.rollout(versions[version], key, jnp.int32(t)), version)
            key = self._next_key(key)

        dispatch_rollout(start)
        for t in range(start, end):
            if k >= 1 and t + 1 < end:
                dispatch_rollout(t + 1)  # sampled while update t trains
            traj, version = pending.pop(t)
            state, metrics = self.update(state, self.to_training(traj), jnp.int32(version))
            # Kept: what the rollouts not yet consumed by an update read (a resume from
            # this state needs exactly these), with this update's result among them.
            needed = {self.behaviour_version(s) for s in range(t + 1, t + 2 + k)}
            if t + 1 in needed:
                versions[t + 1] = self.behaviour_params(state)
            for old in set(versions) - needed:
                del versions[old]
            if k == 0 and t + 1 < end:
                dispatch_rollout(t + 1)
            if history is not None:
                history.clear()
                history.update(versions)
            yield state, metrics

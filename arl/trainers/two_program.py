"""Asynchronous rollouts: the token trainer's step as two programs, overlapped.

    two = arl.build(config)                       # a TwoProgramTrainer where the config
    state = two.init_state()                      # has rollout.policy_lag or rollout.mesh
    for _ in range(100):
        state, metrics = two.train_step(state)    # the `arl.trainers.Trainer` protocol

* `rollout(behaviour_params, state_key, step) -> Trajectory` on the rollout mesh:
  `TokenTrainer.rollout` with the keys and horizon the fused step would draw at `step`.
* `update(state, trajectory, behaviour_version) -> (state, metrics)` on the training mesh:
  `TokenTrainer.learn`, the fused step's signals + update, donating the state.

Parameters move training -> rollout mesh and trajectories rollout -> training mesh onto
the other mesh's `NamedSharding`s (`placement.move`: `jax.device_put` in one process,
shard copies inside each process across several; `arl.trainers.placement` also says
where the meshes lie). Each `train_step` dispatches update t, then rollout t + 1, and
waits on neither: JAX dispatch is asynchronous, so the two run concurrently wherever
they can (disjoint devices; a host tool's wall time). Rollout t samples with the
parameters after max(t - k, 0) updates (k = `policy_lag`); the state
(`TwoProgramState`) holds those k versions as copies on the rollout mesh, each taken
before the update that would donate it, and is what a checkpoint saves.

With k = 0 rollout t + 1 reads update t's result: the synchronous two-program run, the
same numbers as the fused step up to float rounding (two programs partition
differently). Monte Carlo branching and the reuse of rollout
activations need the fused step (`arl.config` refuses them here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from flax import struct

from arl import sharding as sharding_lib
from arl.models import transformer as transformer_lib
from arl.rollout import Trajectory
from arl.trainers import placement
from arl.trainers.state import TrainState, carry_key


@struct.dataclass
class TwoProgramState:
    """The state of a `TwoProgramTrainer`, and all a resume at lag k needs: the train
    state after t updates, and the behaviour parameters rollouts t .. t+k-1 read
    (versions max(s - k, 0)); their trajectories are recomputed from these, bit for bit
    (same programs, parameters and keys)."""

    state: TrainState
    behaviour: tuple  # k parameter trees, on the rollout mesh
    # Partial rollouts (rollout.carried_groups > 0): the episodes rollout t - 1 left
    # unfinished, which rollout t continues, on the rollout mesh; None otherwise.
    carried: Any = None


class TwoProgramTrainer:
    """A `TokenTrainer`'s step split into a rollout and an update program, overlapped at
    a bounded policy lag: an `arl.trainers.Trainer` whose state is a
    `TwoProgramState`. `arl.trainers.build` returns one for a config with a policy lag
    or a rollout mesh. The token trainer's static pieces (`env`, `model`, `sampling`,
    `task_params`, ... : `_READ_THROUGH`) read through to it, so code written for the
    `TokenTrainer` that `build` returns otherwise (evaluation, export) takes this one;
    what takes a state is this class's own (`policy_params`, `abstract_state`, ...)."""

    # The TokenTrainer's attributes that involve no state, read through as they are.
    _READ_THROUGH = frozenset({
        "algorithm", "batch_size", "context_length", "env", "env_names", "lora", "model",
        "num_envs", "policy", "python_rewards", "reward_model", "sampling", "task_params"})

    def __getattr__(self, name):  # only for names not found on the instance or class
        if name in TwoProgramTrainer._READ_THROUGH:
            return getattr(self.__dict__["trainer"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        # Partial rollouts: rollout t reads the episodes rollout t - 1 carried over.
        self.partial_rollout = jax.jit(
            self._partial_rollout,
            out_shardings=(self.trajectory_shardings, replicated, replicated))
        self._initial_carry = jax.jit(trainer.initial_rollout_carry, out_shardings=replicated)
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
        self._ahead: _Ahead | None = None  # see train_step
        # The jitted programs themselves (benchmarks and tests may wrap the attributes).
        self._rollout_program, self._update_program = self.rollout, self.update
        if trainer.carries_episodes:
            self._rollout_program = self.partial_rollout
        self._rollout_first: bool | None = None

    # ------------------------------------------------------------------ programs
    def _rollout(self, behaviour_params, state_key, step) -> Trajectory:
        """Rollout of step `step` (whose `TrainState.key` is `state_key`) with
        `behaviour_params`: the fused step's rollout, keys and horizon."""
        keys = self.trainer.step_keys(state_key)
        with sharding_lib.activation_mesh(self._activation_mesh):
            return self.trainer.rollout(behaviour_params, keys.rollout,
                                        self.trainer.horizon(step))

    def _partial_rollout(self, behaviour_params, state_key, step, carried, version):
        """`_rollout` with partial rollouts: (trajectory, carried episodes, metrics)."""
        keys = self.trainer.step_keys(state_key)
        with sharding_lib.activation_mesh(self._activation_mesh):
            return self.trainer.partial_rollout(behaviour_params, keys.rollout,
                                                self.trainer.horizon(step), carried, version)

    def _rollout_args(self, params, key, step: int, carried) -> tuple:
        """The arguments of rollout `step`'s program (`_rollout_program`)."""
        if carried is None:
            return params, key, jnp.int32(step)
        return params, key, jnp.int32(step), carried, jnp.int32(self.behaviour_version(step))

    def _sample(self, params, key, step: int, carried):
        """Rollout `step` with `params`: (trajectory, the episodes it carries over or
        None, its metrics)."""
        if carried is None:
            return self.rollout(params, key, jnp.int32(step)), None, {}
        return self.partial_rollout(*self._rollout_args(params, key, step, carried))

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

    # ------------------------------------------------------------------ the protocol
    @property
    def config(self):
        return self.trainer.config

    def start(self, state: TrainState, seed: int | None = None) -> TwoProgramState:
        """A run that starts at `state`: its first `policy_lag` rollouts sample with
        `state`'s parameters (those of version 0 for a fresh state); with partial
        rollouts, from fresh carried episodes drawn from `seed` (default config.seed)."""
        carried = None
        if self.trainer.carries_episodes:
            seed = self.config.seed if seed is None else seed
            init_key, _ = jax.random.split(jax.random.key(seed))  # as TokenTrainer's
            carried = self._initial_carry(carry_key(init_key), self.behaviour_params(state))
        return TwoProgramState(state=state,
                               behaviour=(self.behaviour_params(state),) * self.policy_lag,
                               carried=carried)

    def init_state(self, seed: int | None = None) -> TwoProgramState:
        return self.start(self.trainer.init_state(seed), seed)

    def abstract_state(self) -> TwoProgramState:
        """Shapes, dtypes and shardings of the state (the orbax restore target; orbax
        reshards onto them whatever meshes the checkpoint was written from)."""
        state = self.trainer.abstract_state()
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(self.trainer.layout.policy_params, state), self.param_shardings)
        carried = None
        if self.trainer.carries_episodes:
            carried = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._replicated),
                jax.eval_shape(self.trainer.initial_rollout_carry,
                               jax.random.key(0), params))
        return TwoProgramState(state=state, behaviour=(params,) * self.policy_lag,
                               carried=carried)

    def policy_params(self, state: TwoProgramState):
        """The policy's parameters in `state` (`TokenTrainer.policy_params`)."""
        return self.trainer.policy_params(state.state)

    def warm_start(self, state: TwoProgramState, *, log) -> TwoProgramState:
        warmed = self.trainer.warm_start(state.state, log=log)
        return state if warmed is state.state else self.start(warmed)

    def evaluation_report(self, state: TwoProgramState, key: jax.Array):
        return self.trainer.evaluation_report(state.state, key)

    def behaviour_version(self, step: int) -> int:
        """The parameter version (updates applied) rollout `step` samples with."""
        return max(step - self.policy_lag, 0)

    def train_step(self, state: TwoProgramState) -> tuple[TwoProgramState, dict]:
        """Update t = `state.state.step` on rollout t, and rollout t + 1; returns at once
        wherever dispatch is asynchronous (nothing is fetched). Donates `state.state`.

        At a lag >= 1 update t and rollout t + 1 are independent and the one that calls
        the host goes out second (`rollout_first`): a program with host callbacks holds
        the calling thread until it ends (XLA:CPU runs it synchronously), so the other,
        dispatched before it, runs meanwhile. At lag 0 rollout t + 1 reads update t's
        result and follows it.

        The step number, the rollout key and the trajectory of rollout t + 1 are kept
        until the next call: given the state this call returned, that call starts at
        once; given any other (restored, or built by `init_state` / `start`), it reads
        the step from the state and samples rollout t first, so a resumed run recomputes
        the rollouts it had in flight, bit for bit."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.state is state:
            step, key, trajectory = ahead.step, ahead.key, ahead.trajectory
            carried, rollout_metrics = ahead.carried, ahead.rollout_metrics
        else:
            step, key, trajectory = int(state.state.step), self.state_key(state.state), None
            carried, rollout_metrics = state.carried, {}
        k = self.policy_lag
        if trajectory is None:
            params = state.behaviour[0] if k else self.behaviour_params(state.state)
            trajectory, carried, rollout_metrics = self._sample(params, key, step,
                                                                state.carried)
        # Rollout step + k samples with this state's parameters (version `step`): copied
        # before the update donates the state.
        behaviour = state.behaviour[1:] + (self.behaviour_params(state.state),) if k else ()
        update_args = (state.state, self.to_training(trajectory),
                       jnp.int32(self.behaviour_version(step)))
        key = self._next_key(key)
        samples_next = step + 1 < self.config.train_steps  # the last step samples no more
        ahead = None
        if k and samples_next and self.rollout_first(
                self._rollout_args(behaviour[0], key, step + 1, carried), update_args):
            ahead = self._sample(behaviour[0], key, step + 1, carried)
            samples_next = False
        train_state, metrics = self.update(*update_args)
        metrics = {**metrics, **rollout_metrics}
        if samples_next:
            params = behaviour[0] if k else self.behaviour_params(train_state)
            ahead = self._sample(params, key, step + 1, carried)
        result = TwoProgramState(state=train_state, behaviour=behaviour, carried=carried)
        trajectory, carried_next, metrics_next = ahead if ahead is not None else (None,) * 3
        self._ahead = _Ahead(state=result, step=step + 1, key=key, trajectory=trajectory,
                             carried=carried_next, rollout_metrics=metrics_next)
        return result, metrics

    def rollout_first(self, rollout_args, update_args) -> bool:
        """Whether rollout t + 1 is dispatched before update t (lag >= 1): when the
        update calls the host and the rollout does not; otherwise the update goes first.
        Decided once, from the programs' traced effects (host environments call the host
        through ordered `io_callback`s, an effect), the same on every process."""
        if self._rollout_first is None:
            rollout_calls_host = bool(self._rollout_program.trace(*rollout_args).jaxpr.effects)
            update_calls_host = bool(self._update_program.trace(*update_args).jaxpr.effects)
            self._rollout_first = update_calls_host and not rollout_calls_host
        return self._rollout_first


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """What `train_step` dispatched past the state it returned: the step it is at, the
    rollout key of that step and the trajectory of its rollout (None: not sampled)."""

    state: TwoProgramState
    step: int
    key: jax.Array
    trajectory: Trajectory | None
    carried: Any = None  # the episodes that rollout carries over (partial rollouts)
    rollout_metrics: Any = None

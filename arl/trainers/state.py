"""The train state of the token trainer: what a step carries, its initial value, its
abstract shape (the checkpoint restore target) and its shardings on the mesh."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from arl import sharding as sharding_lib
from arl.models import transformer as transformer_lib
from arl.trainers.process_reward_models import ProcessModels
from arl.trainers.policy import Policy


@struct.dataclass
class TrainState:
    """The trained parameters and everything else a step carries.

    Full fine-tuning: `params` is the policy's parameter tree and `ref_params` a frozen
    copy of the initial policy when a KL term or PRIME needs the reference.
    LoRA (model.lora_rank > 0): `params` holds only the trainable part,
    {"lora": adapters} (plus {"value_head": ...} for a critic, trained with the
    adapters), `base_params` the frozen base weights, and the policy is
    `StateLayout.policy_params(state)` = merge_lora(base, adapters); the reference policy
    is the base itself, so `ref_params` stays None (no second copy)."""

    params: Any
    opt_state: Any
    ref_params: Any  # None unless a KL term needs the reference policy (and not LoRA)
    step: jax.Array  # int32 []
    key: jax.Array
    # The learned process reward model and its optimizer state (process.train_prm), and
    # PRIME's implicit PRM (process.implicit_coef > 0); None when unused.
    prm_params: Any = None
    prm_opt_state: Any = None
    implicit_params: Any = None
    implicit_opt_state: Any = None
    # The frozen base weights under LoRA (model.lora_rank > 0); None otherwise.
    base_params: Any = None
    # The frozen outcome reward model (reward_model.hf_checkpoint); None otherwise.
    reward_model_params: Any = None
    # Partial rollouts in the fused step (rollout.carried_groups > 0): the episodes the
    # last rollout left unfinished (`arl.rollout.partial_rollouts.CarriedEpisodes`); None otherwise.
    rollout_carry: Any = None


def carry_key(init_key: jax.Array) -> jax.Array:
    """The key of the episodes partial rollouts start with, from the state's init key."""
    return jax.random.fold_in(init_key, 2)


@dataclasses.dataclass(frozen=True, eq=False)
class StateLayout:
    """How a `TrainState` is made and laid out on `mesh`."""

    policy: Policy
    optimizer: optax.GradientTransformation
    mesh: jax.sharding.Mesh
    uses_reference: bool  # a KL term or PRIME reads the reference policy
    process_models: ProcessModels
    reward_model: Any = None  # an `arl.trainers.reward_model.OutcomeRewardModel`, or None
    # (key, policy params) -> the `CarriedEpisodes` partial rollouts start from, where
    # the state carries them (`TrainState.rollout_carry`); None otherwise.
    initial_carry: Any = None

    def initial(self, init_key, key, pretrained=None, reward_model_params=None) -> TrainState:
        """The state before training: fresh weights (or `pretrained` ones over a fresh
        value head), a fresh optimizer state, step 0 and the step key stream `key`; the
        reward model's loaded parameters `reward_model_params` held as they are."""
        policy_key, prm_key = jax.random.split(init_key)
        params = self.policy.init_params(policy_key)
        if pretrained is not None:  # the checkpoint's weights; a value head stays fresh
            params = {**params, **pretrained}
        if self.policy.lora is not None:
            # The weights above become the frozen base (and the reference policy); the
            # trainable state is the adapters.
            base = params
            params = self.policy.init_adapters(jax.random.fold_in(init_key, 1), base)
            state = TrainState(params=params, opt_state=self.optimizer.init(params),
                               ref_params=None, step=jnp.zeros((), jnp.int32), key=key,
                               base_params=base)
            params = base  # PRIME's implicit PRM (below) starts as the reference
        else:
            state = TrainState(
                params=params,
                opt_state=self.optimizer.init(params),
                ref_params=params if self.uses_reference else None,
                step=jnp.zeros((), jnp.int32),
                key=key,
            )
        if self.initial_carry is not None:
            state = state.replace(rollout_carry=self.initial_carry(
                carry_key(init_key), params))
        return state.replace(reward_model_params=reward_model_params,
                             **self.process_models.initial_fields(
                                 prm_key, params, self.policy.model.config.max_len))

    def unsharded_shape(self) -> TrainState:
        """Shapes and dtypes of the state (no shardings), without allocating it."""
        return self._unsharded_shape

    @functools.cached_property
    def _unsharded_shape(self) -> TrainState:
        # Traced once: the shardings and the checkpoint restore target both ask (each
        # trace of the initial state was ~0.3-1 s of a run's start).
        reward_model = (None if self.reward_model is None
                        else self.reward_model.abstract_params())
        return jax.eval_shape(
            lambda rm: self.initial(jax.random.key(0), jax.random.key(0), None, rm),
            reward_model)

    def abstract(self) -> TrainState:
        """Shapes, dtypes and shardings of the state (orbax restore target)."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.unsharded_shape(), self.shardings())

    @functools.cached_property
    def param_shardings(self):
        """Shardings of the policy's full parameter tree (logical-axis rules)."""
        return transformer_lib.param_shardings(
            transformer_lib.abstract_params(self.policy.model), self.mesh)

    def shardings(self) -> TrainState:
        return self._shardings

    @functools.cached_property
    def _shardings(self) -> TrainState:
        param_shardings = self.param_shardings
        abstract = self.unsharded_shape()
        replicated = sharding_lib.replicated(self.mesh)

        def opt_shardings(optimizer, opt_state, param_shardings):
            return sharding_lib.opt_state_shardings(
                optimizer, opt_state, param_shardings, replicated)

        if self.policy.lora is not None:  # adapters replicated, the base sharded
            trainable = jax.tree.map(lambda _: replicated, abstract.params)
            shardings = TrainState(
                params=trainable,
                opt_state=opt_shardings(self.optimizer, abstract.opt_state, trainable),
                ref_params=None, step=replicated, key=replicated,
                base_params=param_shardings)
        else:
            shardings = TrainState(
                params=param_shardings,
                opt_state=opt_shardings(self.optimizer, abstract.opt_state,
                                        param_shardings),
                ref_params=param_shardings if self.uses_reference else None,
                step=replicated,
                key=replicated,
            )
        if self.reward_model is not None:
            shardings = shardings.replace(
                reward_model_params=self.reward_model.param_shardings(self.mesh))
        if abstract.rollout_carry is not None:
            shardings = shardings.replace(rollout_carry=jax.tree.map(
                lambda _: replicated, abstract.rollout_carry))
        return shardings.replace(**self.process_models.field_shardings(
            abstract, param_shardings, self.mesh, opt_shardings))

    def policy_params(self, state: TrainState) -> Any:
        """The policy's full parameter tree inside a traced step."""
        return self.policy.merge(state.params, state.base_params)

    def reference_params(self, state: TrainState) -> Any:
        """The reference policy's parameters: the frozen base under LoRA."""
        return state.base_params if self.policy.lora is not None else state.ref_params

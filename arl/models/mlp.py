"""MLP actor-critics for vector environments (gymnax), PureJaxRL-style.

Separate actor and critic torsos (no shared trunk), orthogonal initialisation with gain
sqrt(2) on hidden layers, 0.01 on the policy head (a near-uniform initial policy) and 1.0
on the value head, zero biases — the PPO implementation details of Huang et al. 2022,
"The 37 Implementation Details of Proximal Policy Optimization", and PureJaxRL
(Lu et al. 2022, arXiv 2210.01821).
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

_ACTIVATION_FNS = {"tanh": nn.tanh, "relu": nn.relu, "gelu": nn.gelu, "silu": nn.silu}
ACTIVATIONS = tuple(_ACTIVATION_FNS)


def _activation(name: str):
    if name not in _ACTIVATION_FNS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    return _ACTIVATION_FNS[name]


def _check_sizes(hidden_sizes, **positive_ints):
    for field, value in positive_ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} must be a positive int, got {value!r}")
    if not all(isinstance(h, int) and h >= 1 for h in hidden_sizes):
        raise ValueError(f"hidden_sizes must be positive ints, got {hidden_sizes!r}")


def _dense(features: int, gain: float, name: str) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(gain),
                    bias_init=nn.initializers.zeros, name=name)


def _torso(x, hidden_sizes, activation, prefix):
    for i, size in enumerate(hidden_sizes):
        x = activation(_dense(size, math.sqrt(2.0), f"{prefix}_hidden_{i}")(x))
    return x


class ActorCritic(nn.Module):
    """Discrete-action actor-critic: obs [..., D] -> (logits f32 [..., A], value f32 [...]).

    Parameters: actor_hidden_{i}, actor_head, critic_hidden_{i}, critic_head (nn.Dense).
    With `value_only=True` (`model.clone(value_only=True)`, same parameters) it returns
    the value alone and skips the actor's computation.
    """

    num_actions: int
    hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"
    value_only: bool = False

    @nn.compact
    def __call__(self, obs: jax.Array):
        _check_sizes(self.hidden_sizes, num_actions=self.num_actions)
        act = _activation(self.activation)
        x = obs.astype(jnp.float32)
        value = _dense(1, 1.0, "critic_head")(_torso(x, self.hidden_sizes, act, "critic"))[..., 0]
        if self.value_only:
            return value
        logits = _dense(self.num_actions, 0.01, "actor_head")(
            _torso(x, self.hidden_sizes, act, "actor"))
        return logits, value


class GaussianActorCritic(nn.Module):
    """Continuous-action actor-critic: obs [..., D] ->
    (mean f32 [..., A], log_std f32 [..., A], value f32 [...]).

    log_std is a state-independent learned vector initialised at 0 (std 1), as in PureJaxRL's
    continuous PPO; it is broadcast to the batch shape.
    """

    action_dim: int
    hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        _check_sizes(self.hidden_sizes, action_dim=self.action_dim)
        act = _activation(self.activation)
        x = obs.astype(jnp.float32)
        mean = _dense(self.action_dim, 0.01, "actor_head")(
            _torso(x, self.hidden_sizes, act, "actor"))
        log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
        value = _dense(1, 1.0, "critic_head")(_torso(x, self.hidden_sizes, act, "critic"))[..., 0]
        return mean, jnp.broadcast_to(log_std, mean.shape), value

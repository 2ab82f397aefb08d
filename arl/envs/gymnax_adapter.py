"""Any gymnax environment as an `arl` environment (gymnax is imported lazily).

gymnax 1.0's `step` auto-resets and returns six values (obs, state, reward,
terminated, truncated, info). The adapter instead calls `step_env` and `is_truncated`
with the same key split gymnax uses (`split(key)[0]` for the transition), keeps
terminated and truncated apart, puts the step's observation in
`info["final_observation"]` and does NOT reset: a finished episode stays finished
(reward 0, zero observation, state unchanged). `AutoReset(GymnaxEnvironment(name))`
reproduces gymnax's own `step` exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from arl.envs.base import Box, Discrete, Environment, TimeStep, tree_select


@struct.dataclass
class GymnaxState:
    env_state: Any
    terminated: jax.Array
    truncated: jax.Array


def _strong(tree):
    """Drop weak types (gymnax returns some python-scalar-derived leaves), so the
    timesteps of reset and step have identical dtypes inside a `lax.scan` carry."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.asarray(x).dtype), tree)


def _convert_space(space):
    kind = type(space).__name__
    if kind == "Discrete":
        return Discrete(int(space.n))
    if kind == "Box":
        return Box(space.low, space.high, tuple(space.shape), space.dtype)
    return space


class GymnaxEnvironment(Environment):
    """`GymnaxEnvironment("CartPole-v1", **make_kwargs)` or around a gymnax env object."""

    def __init__(self, env_id: str | Any, **make_kwargs):
        try:
            import gymnax
        except ImportError as err:  # pragma: no cover - gymnax is installed in CI
            raise ImportError("GymnaxEnvironment needs the optional package gymnax "
                              "(pip install gymnax)") from err
        if isinstance(env_id, str):
            if env_id not in gymnax.registered_envs:
                raise ValueError(f"env_id {env_id!r} is not a gymnax environment; known: "
                                 f"{sorted(gymnax.registered_envs)}")
            self.env, self._default_params = gymnax.make(env_id, **make_kwargs)
            self.name = f"gymnax:{env_id}"
        else:
            self.env, self._default_params = env_id, env_id.default_params
            self.name = f"gymnax:{env_id.name}"

    def default_params(self):
        return self._default_params

    @property
    def observation_space(self):
        return _convert_space(self.env.observation_space(self._default_params))

    @property
    def action_space(self):
        return _convert_space(self.env.action_space(self._default_params))

    def _info_template(self, key, env_state, params):
        """Zero-filled info of the gymnax step (so reset's info has the same structure)."""
        action = self.env.action_space(params).sample(key)
        shapes = jax.eval_shape(lambda: self.env.step_env(key, env_state, action, params)[4])
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def reset(self, key, params):
        observation, env_state = self.env.reset_env(key, params)
        info = {**self._info_template(key, env_state, params), "final_observation": observation}
        false = jnp.zeros((), bool)
        timestep = TimeStep(observation=observation, reward=jnp.zeros((), jnp.float32),
                            terminated=false, truncated=false, info=info)
        return _strong((GymnaxState(env_state, false, false), timestep))

    def step(self, key, state: GymnaxState, action, params):
        key_step, _ = jax.random.split(key)
        observation, env_state, reward, terminated, info = self.env.step_env(
            key_step, state.env_state, action, params)
        truncated = jnp.asarray(self.env.is_truncated(env_state, params), bool)
        terminated = jnp.asarray(terminated, bool)
        live = TimeStep(observation=observation, reward=jnp.asarray(reward, jnp.float32),
                        terminated=terminated, truncated=truncated,
                        info={**info, "final_observation": observation})
        live_state = GymnaxState(env_state, terminated, truncated)
        zeros = jax.tree.map(jnp.zeros_like, live)
        finished = zeros.replace(terminated=state.terminated, truncated=state.truncated)
        was_done = state.terminated | state.truncated
        return _strong(tree_select(was_done, (state, finished), (live_state, live)))

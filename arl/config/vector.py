"""`config.vector`: vector environments (algorithm "ppo_vector", e.g. env.name
"gymnax:CartPole-v1") and their MLP actor-critic (arl.trainers.vector_ppo)."""

from __future__ import annotations

import ml_collections

from arl import envs as envs_lib
from arl.config.checks import check_bool, check_choice, check_range, fail
from arl.envs.registry import GYMNAX_PREFIX
from arl.errors import did_you_mean
from arl.models.mlp import ACTIVATIONS


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.num_envs = 4
    c.num_steps = 128
    c.hidden_sizes = (64, 64)
    c.activation = "tanh"
    # Per-minibatch diagnostics besides the losses and the entropy: policy clip fractions,
    # approximate KL, ratio range, value clip fraction, explained variance, gradient norm.
    # False logs only the losses and the entropy (as PureJaxRL does), which makes a small
    # update a few percent cheaper on CPU.
    c.diagnostics = True
    return c


def validate(config) -> None:
    """The vector trainer's settings, and the env and update settings it cannot serve."""
    name = str(config.env.name)
    if not name.startswith(GYMNAX_PREFIX):
        fail("env.name", config.env.name,
             "algorithm 'ppo_vector' needs a vector env such as 'gymnax:CartPole-v1'")
    params = dict(config.env.params)
    if params:
        fail("env.params", params, "algorithm 'ppo_vector' runs the gymnax env's default "
             "params and does not apply config.env.params: leave it empty")
    check_range(config, "vector.num_envs", 1, integer=True)
    check_range(config, "vector.num_steps", 1, integer=True)
    check_choice(config, "vector.activation", ACTIVATIONS)
    check_bool(config, "vector.diagnostics")
    if config.updates.shuffle != "rows":
        fail("updates.shuffle", config.updates.shuffle,
             "the vector trainer has no groups: allowed value is 'rows'")
    batch = config.vector.num_envs * config.vector.num_steps
    if batch % config.updates.minibatches:
        fail("updates.minibatches", config.updates.minibatches,
             f"must divide vector.num_envs*vector.num_steps={batch}")
    try:
        import gymnax  # pylint: disable=g-import-not-at-top
    except ImportError:
        gymnax = None
    if gymnax is not None:
        env_id = name[len(GYMNAX_PREFIX):]
        if env_id not in gymnax.registered_envs:
            fail("env.name", name, "not a gymnax environment"
                 f"{did_you_mean(env_id, gymnax.registered_envs, 'gymnax:')}")
        envs_lib.make_env(config.env)  # constructor arguments, as a ConfigError

"""arl: JAX-native, functional agentic reinforcement learning.

The public face; the layers below it (docs/architecture.md):

    arl.algorithms   pure kernels (advantages, losses, filters): jax, chex, numpy only
    arl.algorithm_table  one row per `config.algorithm` (credit family, policy loss)
    arl.envs         jittable environments, the registry, env construction from config
    arl.models       Flax models (decoder LM with value head, MLP actor-critic), sampling
    arl.rollout      multi-turn rollouts and Monte Carlo branching, inside the step
    arl.trainers     the compiled train steps (token envs, vector envs), warm start
    arl.data         task sets and demonstrations on disk
    arl.runs         the experiment loop, evaluation, checkpoints, metric writers
"""

import importlib

__version__ = "0.1.0"

# Imported on first use (PEP 562), so `import arl.algorithms` loads the kernels and
# nothing else: a user composing our losses into their own code needs only jax, chex
# and numpy, while `arl.build`, `arl.default_config` and the rest load their layer when
# first touched.
_SUBMODULES = frozenset({
    "algorithm_table", "algorithms", "backend", "caches", "config", "data", "envs", "errors",
    "host", "models", "optim", "rollout", "sharding", "tools", "trainers",
})
_EXPORTS = {
    "Algorithm": "arl.algorithm_table",
    "OutcomeBatch": "arl.algorithm_table",
    "register_algorithm": "arl.algorithm_table",
    "ConfigError": "arl.errors",
    "default_config": "arl.config",
    "validate": "arl.config",
    "TokenEnvironment": "arl.envs",
    "make_env": "arl.envs",
    "register": "arl.envs",
    "Trajectory": "arl.rollout",
    "TokenTrainer": "arl.trainers",
    "TrainState": "arl.trainers",
    "VectorPPO": "arl.trainers",
    "build": "arl.trainers",
}

__all__ = sorted({"algorithms", "envs", "rollout", "trainers", *_EXPORTS})


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"arl.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'arl' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES | set(_EXPORTS))

"""arl: JAX-native, functional agentic reinforcement learning.

    import arl
    arl.setup()                       # process settings, once, first (arl.runs.process_settings)
    trainer = arl.build(config)       # validates; changes nothing global
    state, metrics = trainer.train_step(trainer.init_state())

The public face; the layers below it, top down (docs/architecture.md, checked by
tests/test_layers.py):

    arl.runs         the effectful shell: `setup`, the experiment loop, evaluation,
                     checkpoints, metric writers
    arl.trainers     the compiled train steps (token envs, vector envs), warm start
    arl.rollout      multi-turn rollouts, Monte Carlo branching, episode datasets
    arl.config       the config schema and its validation
    arl.envs         jittable environments, the registry, env construction from config
    arl.algorithm_table  one row per `config.algorithm` (credit family, policy loss)
    arl.rewards      Python reward functions, scored on the host
    arl.data         text tasks on disk (tfds array_record)
    arl.models       Flax models (decoder LM with value head, MLP actor-critic), sampling
    arl.algorithms   pure kernels (advantages, losses, filters): jax, chex, numpy only
    arl.text         codecs, tokenizers, chat templates, in-jit parsing and verifiers
    arl.tools        host-side tool executors (sandboxed Python, SQL)
    arl.optim, arl.sharding, arl.backend, arl.caches, arl.errors   foundations
"""

import importlib

__version__ = "0.1.0"

# Imported on first use (PEP 562), so `import arl.algorithms` loads the kernels and
# nothing else: a user composing our losses into their own code needs only jax, chex
# and numpy, while `arl.build`, `arl.default_config` and the rest load their layer when
# first touched.
_SUBMODULES = frozenset({
    "algorithm_table", "algorithms", "backend", "caches", "config", "data", "envs", "errors",
    "models", "optim", "rewards", "rollout", "runs", "sharding", "text", "tools", "trainers",
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
    "setup": "arl.runs.process_settings",
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

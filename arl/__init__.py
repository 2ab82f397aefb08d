"""arl: JAX-native, functional agentic reinforcement learning.

The public face; the layers below it (docs/architecture.md):

    arl.algorithms   pure kernels (advantages, losses, filters) and the algorithm table
    arl.envs         jittable environments, the registry, env construction from config
    arl.models       Flax models (decoder LM with value head, MLP actor-critic), sampling
    arl.rollout      multi-turn rollouts and Monte Carlo branching, inside the step
    arl.trainers     the compiled train steps (token envs, vector envs), warm start
    arl.data         task sets and demonstrations on disk
    arl.runs         the experiment loop, evaluation, checkpoints, metric writers
"""

from arl import algorithms, envs, rollout, trainers
from arl.algorithms import Algorithm, register_algorithm
from arl.config import ConfigError, default_config, validate
from arl.envs import TokenEnvironment, make_env, register
from arl.rollout import Trajectory
from arl.trainers import TokenTrainer, TrainState, VectorPPO, build

__version__ = "0.1.0"

__all__ = [
    "Algorithm", "ConfigError", "TokenEnvironment", "TokenTrainer", "TrainState",
    "Trajectory", "VectorPPO", "algorithms", "build", "default_config", "envs", "make_env",
    "register", "register_algorithm", "rollout", "trainers", "validate",
]

r"""PPO on gymnax CartPole-v1 with PureJaxRL's hyperparameters (a vector-env baseline).

4 environments x 128 steps per update, 4 epochs x 4 minibatches, gamma 0.99, GAE lambda
0.95, clip 0.2, entropy 0.01, value 0.5, Adam lr 2.5e-4 decayed linearly to 0, global
grad-norm clip 0.5, a tanh 64x64 actor-critic. 977 updates = 977 * 512 ~ 500k env
steps; the episode return reaches ~500 (the maximum), in a few minutes on one CPU.

    python -m experiments.train --config=configs/ppo_cartpole.py --workdir=/tmp/cartpole

Scale up: `vector.num_envs` is the batch (PureJaxRL vmaps over seeds on top); keep
`vector.num_envs * vector.num_steps` divisible by `updates.minibatches`.
"""

from arl import config as config_lib


def get_config():
    c = config_lib.default_config()
    c.algorithm = "ppo_vector"
    c.env.name = "gymnax:CartPole-v1"
    c.train_steps = 977
    c.log_every = 10
    c.checkpoint_every = 200
    c.sample_every = 0  # vector envs have no text transcripts
    c.vector.num_envs = 4
    c.vector.num_steps = 128
    c.vector.hidden_sizes = (64, 64)
    c.vector.activation = "tanh"
    c.updates.epochs = 4
    c.updates.minibatches = 4
    c.advantage.gamma = 0.99
    c.advantage.lam = 0.95
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.2
    c.loss.entropy_coef = 0.01
    c.loss.value_coef = 0.5
    c.optim.learning_rate = 2.5e-4
    c.optim.schedule = "linear"
    c.optim.max_grad_norm = 0.5
    c.optim.b2 = 0.999  # PureJaxRL's Adam: optax defaults, eps 1e-5
    c.optim.eps = 1e-5
    return c

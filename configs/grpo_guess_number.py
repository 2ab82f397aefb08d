r"""GRPO on `guess_number` (find a hidden integer in [0, 16) from higher/lower replies).

A multi-turn task where RL from scratch is feasible: an action is just a number, so a
random policy stumbles on valid guesses and on the answer. A small SFT term on a weak
(linear-scan) demonstrator, decaying to zero, speeds up format learning; RL then has to
beat its teacher by bisecting (fewer turns, higher success within the turn budget).

    python -m experiments.train --config=configs/grpo_guess_number.py --workdir=/tmp/gn

Scale up: `env.kwargs.max_n` (e.g. 100 or 1000: more turns, longer contexts), a wider
and deeper model, `rollout.num_tasks` (more distinct tasks per step) and
`rollout.group_size` (a better group baseline); on a device slice set `mesh` so that
num_tasks * group_size divides over data * fsdp.
"""

from arl import config as config_lib


def get_config():
    c = config_lib.default_config()
    c.algorithm = "grpo"
    c.env.name = "guess_number"
    c.env.kwargs.max_n = 16
    c.train_steps = 150
    c.log_every = 5
    c.sample_every = 25
    c.checkpoint_every = 50
    c.rollout.num_tasks = 16
    c.rollout.group_size = 8
    c.rollout.temperature = 1.0
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.mlp_dim = 256
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 5
    c.loss.agg = "token-mean"
    c.loss.sft_coef = 0.2
    c.loss.sft_coef_final = 0.0
    c.loss.sft_decay_steps = 100
    c.loss.sft_source = "demonstrator"
    return c

r"""SFT then GRPO on 2-digit `calculator` (a `<calc>a*b</calc>` tool call, then the answer).

A randomly initialised decoder cannot discover the tool-call format by sampling, so the
policy is first behaviour-cloned on the environment's *weak* demonstrator (on its first
turn it skips the tool half the time and answers from "mental arithmetic", which is off
by a random non-zero amount half the time: success 0.75), then trained with GRPO (plus a
small SFT floor, alpha 0.05): RL must learn to always call the tool. The two stages:

    python -m experiments.train --config=configs/grpo_calculator.py --workdir=/tmp/calc
    python -m experiments.learning_stages --config=configs/grpo_calculator.py

(`c.warm_start` below sets stage 1, run by both; `learning_stages` also reports the
baselines and the SFT-only policy.)
Measured numbers: benchmarks/RESULTS.md, "Learning"; test:
tests/test_learning_token_slow.py.

`max_turns = 2` is the oracle's horizon (one tool call, one answer); it keeps the
context short (80 tokens) for this CPU. Scale up: `env.kwargs.max_digits` (up to 4),
`max_turns`, a larger model, more tasks per step, a precomputed demonstration set
(`loss.sft_dataset`, see `arl.datasets`), and `mesh` for a device slice.
"""

from arl import config as config_lib


def get_config():
    c = config_lib.default_config()
    # Stage 1 (arl.warm_start, run by experiments.train and experiments.learning_stages):
    # behaviour cloning on the demonstrator, sft_steps of sft_batch fresh
    # demonstrations each, AdamW at sft_lr; stage 2 (RL) starts from those weights.
    c.warm_start.sft_steps = 400
    c.warm_start.sft_batch = 64
    c.warm_start.sft_lr = 3e-3
    c.algorithm = "grpo"
    c.env.name = "calculator"
    c.env.kwargs.max_digits = 2
    c.env.kwargs.max_turns = 2
    c.train_steps = 100
    c.log_every = 5
    c.sample_every = 25
    c.checkpoint_every = 50
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    c.rollout.temperature = 1.0
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.mlp_dim = 256
    c.optim.learning_rate = 3e-4
    c.optim.warmup_steps = 10
    c.optim.schedule = "constant"
    c.loss.agg = "token-mean"
    c.loss.sft_coef = 0.05
    c.loss.sft_coef_final = -1.0
    c.loss.sft_source = "demonstrator"
    return c

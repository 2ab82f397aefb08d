r"""SFT then GRPO on `code_interpreter`: write a Python cell, read its output, answer.

The environment (`arl.envs.tasks.code_interpreter`) asks questions whose answers need
computation ("sum of squares 1..37"); the agent runs a cell in the sandbox
(`<py>sum(i*i for i in range(1,37+1))</py>`, reply "17575") and then answers
(`<answer>17575</answer>`). Stage 1 behaviour-clones the environment's *weak*
demonstrator (it answers a guess without running code 30 % of the time and writes an
off-by-one program 20 % of the time: success 0.56); stage 2 is GRPO with a small SFT
floor, which must learn to always run the right program:

    python -m experiments.train --config=configs/grpo_code_interpreter.py --workdir=/tmp/code
    python -m experiments.evaluate --workdir=/tmp/code --num_tasks=128
    python -m experiments.learning_stages --config=configs/grpo_code_interpreter.py

Every tool call is a sandboxed Python process (`arl.tools.run_python`, ~40-100 ms of
host time; a batch of 64 runs on a pool of threads); identical cells are answered from
the environment's result cache, which makes the warm start's demonstrations cheap.
Measured numbers: docs/learning.md, "Measured results"; test:
tests/test_learning_tools_slow.py.
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "code_interpreter"
    c.env.kwargs.max_turns = 2
    c.env.kwargs.families = ("squares", "cubes", "multiples", "digits")
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    c.train_steps = 100
    recipes.warm_start(c, steps=300)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: GRPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

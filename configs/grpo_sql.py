r"""SFT then GRPO on `sql`: query a small generated SQLite database, read the rows, answer.

Every task has its own database (`departments`, `employees`, `orders`; the schema is the
same for all tasks) and a templated question ("What is the total salary of the sales
department?"); the agent runs one read-only query (`<sql>SELECT ...</sql>`, reply: a
header and the rows) and answers (`<answer>52300</answer>`). Stage 1 behaviour-clones
the environment's *weak* demonstrator (it answers a guess without querying 30 % of the
time: success 0.7); stage 2 is GRPO with a small SFT floor, which must learn to always
query:

    python -m experiments.train --config=configs/grpo_sql.py --workdir=/tmp/sql
    python -m experiments.evaluate --workdir=/tmp/sql --num_tasks=128
    python -m experiments.learning_stages --config=configs/grpo_sql.py

The reference queries are long (up to 133 characters: joins, COALESCE), so the context
is 489 tokens, about three times the code interpreter's; queries themselves cost the
host well under a millisecond each (`arl.tools.run_sql`). Not measured to convergence
on the shared CPU (docs/learning.md).
"""

from arl import config as config_lib
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "grpo"
    c.env.name = "sql"
    c.env.kwargs.max_turns = 2
    c.rollout.num_tasks = 8
    c.rollout.group_size = 8
    c.train_steps = 100
    recipes.warm_start(c, steps=400)  # stage 1: clone the demonstrator
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: GRPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

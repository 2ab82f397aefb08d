r"""SFT then ERPO on a mixture of Sokoban, Countdown and arithmetic word problems.

One batch holds the three token environments of `grpo_sokoban` (5 x 5, one box, three
turns of up to 3 moves, no per-move penalty), `grpo_countdown` (three numbers in [1, 9],
targets in [1, 100], two attempts) and `grpo_word_problems` (the shipped 300 problems'
training split, numeric verifier, two attempts), as a `mixture` (`arl.envs.Mixture`: one
character codec; the context is the members' largest, 290 tokens; task i of a step runs
member i % 3). Stage 1 behaviour-clones each member's weaker demonstrator (Sokoban 0.75,
Countdown 0.52, word problems 0.74 on 1024 mixed episodes) for 900 steps of 96 mixed
demonstrations (~32 of each member a step); stage 2 is 150 steps of ERPO (12 tasks x 8
samples, four tasks of each member a step; AdamW 3e-4 with 10 warmup steps, SFT floor
0.05). ERPO divides each trajectory's group-centred reward by the std pooled over its
*environment*, so Sokoban's returns of ~11 do not drown the others' returns of 1.

Measured (seed 0, shared 2-core CPU at load average 3-8, 41 + 18 minutes;
`experiments.learning_stages`, 4 x 96 fresh tasks = 128 per member, sampled / greedy):

    member          demonstrator  SFT alone    SFT + ERPO
    sokoban         0.75          0.25 / 0.77  0.69 / 0.85
    countdown       0.52          0.30 / 0.30  0.40 / 0.41
    word problems   0.74          0.34 / 0.63  0.66 / 0.71
    all             0.67          0.30 / 0.57  0.58 / 0.66

(untrained: 0.04). The rollouts' success rises from 0.29 over RL steps 1-10 to 0.56 over
steps 141-150 (Sokoban 0.37 -> 0.68, Countdown 0.21 -> 0.40, word problems 0.30 -> 0.59).
Stage 1 here has three times the optimizer steps of the single-env configs' (and 1.5x
their Sokoban and Countdown demonstrations), so the members' numbers are not a
controlled comparison with `grpo_sokoban` / `grpo_countdown`; `grpo_sokoban` given the
same Sokoban stage-1 data and steps (900 x 32) reached only 0.17 / 0.37 after SFT and
0.30 / 0.58 after GRPO (one seed; docs/learning.md, "Measured results").

    python -m experiments.learning_stages --config=configs/erpo_games.py

Test: tests/test_learning_games_slow.py.
"""

from arl import config as config_lib
from arl.data import word_problems
from configs import recipes


def get_config():
    c = config_lib.default_config()  # a 2-layer d_model-64 decoder
    c.algorithm = "erpo"
    c.env.name = "mixture"
    c.env.members = (
        {"name": "sokoban",  # as configs/grpo_sokoban.py
         "kwargs": {"max_size": 5, "max_boxes": 1, "max_turns": 3,
                    "max_actions_per_turn": 3},
         "params": {"step_reward": 0.0}},
        {"name": "countdown",  # as configs/grpo_countdown.py
         "kwargs": {"max_numbers": 3, "max_number": 9, "max_target": 100, "max_turns": 2}},
        {"name": "dataset_task",  # as configs/grpo_word_problems.py
         "kwargs": {"path": word_problems.SHIPPED_JSONL, "split": "train",
                    "verifier": "numeric", "max_turns": 2}},
    )
    c.advantage.erpo_centre_on_env_mean = False
    c.train_steps = 150
    c.rollout.num_tasks = 12  # four tasks of each member per step
    c.rollout.group_size = 8
    recipes.warm_start(c, steps=900, batch=96)  # stage 1: clone the three demonstrators
    recipes.gentle_rl(c, learning_rate=3e-4, warmup_steps=10)  # stage 2: ERPO ...
    recipes.sft_floor(c, 0.05)  # ... with a small SFT floor
    return c

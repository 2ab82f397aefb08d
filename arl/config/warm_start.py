"""`config.warm_start`: behaviour cloning on scripted demonstrations before RL
(arl.trainers.warm_start)."""

from __future__ import annotations

import ml_collections

from arl import algorithm_table
from arl.config.checks import check_range, fail
from arl.envs.base import SCRIPTED_SOURCES as SFT_SOURCES


def defaults() -> ml_collections.ConfigDict:
    # A fresh run trains the model for sft_steps on scripted demonstrations from
    # sft_source ("" = loss.sft_source; "demonstrator": the env's weaker demonstrator),
    # sft_batch fresh ones per step (0 = the RL batch num_tasks*group_size), AdamW at
    # sft_lr (0 = optim.learning_rate). RL then starts from those weights (the KL
    # reference too; under LoRA they are the frozen base). 0 steps = RL from the initial
    # model. Token environments only.
    c = ml_collections.ConfigDict()
    c.sft_steps = 0
    c.sft_batch = 0
    c.sft_lr = 0.0
    c.sft_source = ""
    return c


def validate(config, algorithm: algorithm_table.Algorithm) -> None:
    ws = config.warm_start
    check_range(config, "warm_start.sft_steps", 0, integer=True)
    check_range(config, "warm_start.sft_batch", 0, integer=True)
    check_range(config, "warm_start.sft_lr", 0.0)
    if ws.sft_source not in SFT_SOURCES + ("",):
        fail("warm_start.sft_source", ws.sft_source,
             f"allowed values are {SFT_SOURCES} or '' (= loss.sft_source)")
    if ws.sft_steps and algorithm.trainer == "vector":
        fail("warm_start.sft_steps", ws.sft_steps,
             "the warm start clones token-environment demonstrations; "
             f"algorithm {algorithm.name!r} has none: set 0")

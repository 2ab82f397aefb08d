"""Every token algorithm's reduced-size learning test (the full runs are in
tests/test_learning.py, marked slow).

Protocol (DESIGN.md section 7): one behaviour-cloning warm start on the bandit's *weaker*
demonstrator (it pulls the worse arm half the time) is shared by all algorithms; each
algorithm then trains with RL alone (no SFT term) for 20 steps of 8 tasks x 8 samples, and
must end well above both its start and the demonstrator it was cloned from. That gap is
what RL adds over SFT and over the teacher.

Measured (seed 0, this recipe; mean sampled success of the first 2 -> last 5 steps):
grpo 0.28 -> 0.91, drgrpo 0.32 -> 0.91, rloo 0.32 -> 0.91, reinforce_pp 0.32 -> 0.91,
ppo (critic, token GAE) 0.40 -> 0.93, erpo 0.32 -> 0.87; on the two-pull bandit vineppo
0.58 -> 0.92 (demonstrators: one pull 0.47, two pulls 0.74). About 25 s per algorithm
(most of it compilation) after a 30 s warm start.

The tests are spread over the pytest-xdist workers; each worker process computes a warm
start once (`_warm_start` is cached).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from arl import rollout as rollout_lib
from arl import warm_start
from arl.train import Trainer

# Independent runs: let pytest-xdist spread them over both workers (tests/conftest.py).
SPREAD_OVER_WORKERS = True

RL_STEPS = 20
SFT_STEPS = 40


def _config(algorithm: str, num_pulls: int):
    import configs.grpo_bandit as grpo_bandit

    c = grpo_bandit.get_config()
    c.algorithm = algorithm
    c.env.kwargs = {"num_pulls": num_pulls}
    c.rollout.num_tasks, c.rollout.group_size = 8, 8
    c.loss.sft_coef = 0.0  # RL alone after the warm start
    if algorithm == "vineppo":
        c.process.mc_samples = 2  # fork the state between the two pulls twice per row
    return c


@functools.lru_cache(maxsize=None)
def _warm_start(num_pulls: int):
    """(SFT params as NumPy, the demonstrator's success on 256 tasks)."""
    trainer = Trainer(_config("grpo", num_pulls))
    params = warm_start.sft_warm_start(trainer, SFT_STEPS, learning_rate=3e-3,
                                       batch_size=64)
    demo = rollout_lib.scripted_rollout(trainer.env, jax.random.key(7), num_tasks=256,
                                        group_size=1, action_source="demonstrator")
    return (jax.tree.map(np.asarray, params),
            float(np.mean(np.asarray(demo.success))))


@pytest.mark.parametrize("algorithm,num_pulls", [
    ("grpo", 1), ("drgrpo", 1), ("rloo", 1), ("reinforce_pp", 1), ("ppo", 1),
    ("erpo", 1), ("vineppo", 2)])
def test_rl_from_a_shared_warm_start_beats_the_start_and_the_demonstrator(algorithm,
                                                                        num_pulls):
    sft_params, demonstrator = _warm_start(num_pulls)
    trainer = Trainer(_config(algorithm, num_pulls))
    state = warm_start.start_state(trainer, jax.tree.map(np.copy, sft_params))
    history = []
    for _ in range(RL_STEPS):
        state, metrics = trainer.train_step(state)
        history.append(float(metrics["success_rate"]))  # the rollout before the update
    history = np.asarray(history)
    start, late = history[:2].mean(), history[-5:].mean()
    assert start < demonstrator, history  # the clone is no better than its teacher
    assert late > start + 0.3, history
    assert late > demonstrator + 0.1, (demonstrator, history)
    assert late > 0.8, history

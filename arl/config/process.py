"""`config.process`: credit assignment inside an episode: process rewards, Monte Carlo
values by forking the env state, learned and implicit process reward models
(arl.algorithms.process, arl.rollout.branching)."""

from __future__ import annotations

import ml_collections

from arl.config.checks import check_choice, check_range, fail
from arl.algorithms.process import MC_ESTIMATES


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.outcome_weight = 1.0  # weight of the environment's reward
    c.reward_weight = 0.0  # weight of the env's per-turn `info["process_reward"]`
    c.turn_gamma = 1.0  # per-turn discount of process returns and MC values
    # Monte Carlo values by forking the env state (algorithm "vineppo", and the labels of
    # the process reward model): continuations per branch point, the turns to branch
    # before (() = every turn 1 .. max_turns-1; turn 0's value is the group's
    # leave-one-out mean return when group_size >= 2) and the estimate.
    c.mc_samples = 0
    c.branch_turns = ()
    c.mc_estimate = "mean_return"
    # A learned process reward model (PRM): a value-head transformer trained by binary
    # cross-entropy on the Monte Carlo success fractions (needs mc_samples >= 1); with
    # prm_weight > 0 its score differences phi(s_k+1) - phi(s_k) are a dense turn reward.
    c.train_prm = False
    c.prm_weight = 0.0
    c.prm_learning_rate = 1e-3
    # PRIME implicit process rewards r_t = beta * log(pi_phi / pi_ref) per token, from an
    # implicit PRM pi_phi trained on the outcome (success) with cross-entropy; 0 = off.
    c.implicit_coef = 0.0
    c.implicit_weight = 1.0
    return c


def validate(config) -> None:
    p = config.process
    for field in ("outcome_weight", "reward_weight", "prm_weight", "implicit_coef",
                  "implicit_weight"):
        check_range(config, f"process.{field}", 0.0)
    check_range(config, "process.turn_gamma", 0.0, 1.0)
    check_range(config, "process.mc_samples", 0, integer=True)
    check_range(config, "process.prm_learning_rate", 0.0, low_open=True)
    check_choice(config, "process.mc_estimate", MC_ESTIMATES)
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in p.branch_turns):
        fail("process.branch_turns", p.branch_turns, "expected distinct turn indices >= 0")
    if p.train_prm and p.mc_samples < 1:
        fail("process.train_prm", p.train_prm,
             "the PRM learns from Monte Carlo labels: set process.mc_samples >= 1")
    if p.prm_weight > 0 and not p.train_prm:
        fail("process.prm_weight", p.prm_weight,
             "a PRM reward needs a trained PRM: set process.train_prm=True")

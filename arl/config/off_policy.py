"""Asynchronous rollouts: `config.rollout.policy_lag`, `config.rollout.mesh` and the
off-policy correction `config.loss.off_policy_*` (their defaults live with their sections,
`arl.config.rollout` and `arl.config.loss`; docs/async.md), checked together."""

from __future__ import annotations

import math

import ml_collections

from arl import algorithm_table
from arl import algorithms as alg
from arl.config.checks import check_choice, check_range, fail
from arl.sharding import MESH_AXES


def uses_two_programs(config: ml_collections.ConfigDict) -> bool:
    """Whether the token trainer runs rollout and update as two programs
    (`arl.trainers.two_program`): a policy lag or a rollout mesh of its own."""
    return config.rollout.policy_lag > 0 or bool(tuple(config.rollout.mesh))


def validate(config, num_devices: int | None,
             algorithm: algorithm_table.Algorithm) -> None:
    """The off-policy correction, the policy lag and the rollout mesh."""
    loss, r = config.loss, config.rollout
    mesh = tuple(config.mesh)
    check_choice(config, "loss.off_policy_correction", alg.CORRECTIONS)
    check_choice(config, "loss.off_policy_level", alg.WEIGHT_LEVELS)
    check_range(config, "loss.off_policy_cap", 1.0)
    check_range(config, "loss.off_policy_low", 0.0, 1.0)
    check_range(config, "loss.off_policy_high", 1.0)
    check_range(config, "rollout.policy_lag", 0, integer=True)
    rollout_mesh = tuple(r.mesh)
    if rollout_mesh and (len(rollout_mesh) != 3 or any(
            not isinstance(m, int) or m < 1 for m in rollout_mesh)):
        fail("rollout.mesh", rollout_mesh, f"expected () (the training mesh's devices) or "
             f"three positive integers for axes {MESH_AXES}")
    if rollout_mesh and num_devices is not None and (
            math.prod(mesh) + math.prod(rollout_mesh) > num_devices):
        fail("rollout.mesh", rollout_mesh,
             f"the training mesh {mesh} takes {math.prod(mesh)} devices and this one "
             f"{math.prod(rollout_mesh)}: {math.prod(mesh) + math.prod(rollout_mesh)} > "
             f"the {num_devices} that exist (use () to share the training devices)")
    batch = r.num_tasks * r.group_size
    if rollout_mesh and batch % (rollout_mesh[0] * rollout_mesh[1]):
        fail("rollout.mesh", rollout_mesh, f"batch num_tasks*group_size={batch} must be "
             f"divisible by its data*fsdp={rollout_mesh[0] * rollout_mesh[1]}")
    if algorithm.trainer != "token" and loss.off_policy_correction != "none":
        fail("loss.off_policy_correction", loss.off_policy_correction,
             f"the {algorithm.trainer} trainer has no off-policy correction: allowed "
             "value is 'none'")
    if not uses_two_programs(config):
        return
    if algorithm.trainer != "token":
        fail("rollout.policy_lag" if r.policy_lag else "rollout.mesh",
             r.policy_lag if r.policy_lag else rollout_mesh,
             f"the {algorithm.trainer} trainer has the fused step only: allowed value is "
             f"{0 if r.policy_lag else ()}")
    if r.policy_lag > 0 and loss.off_policy_correction == "none":
        fail("loss.off_policy_correction", "none",
             f"rollout.policy_lag={r.policy_lag} samples with parameters up to "
             f"{r.policy_lag} updates old: choose one of {alg.CORRECTIONS[1:]}")
    if config.process.mc_samples > 0:
        fail("process.mc_samples", config.process.mc_samples, "Monte Carlo branching "
             "needs the fused step (rollout.policy_lag=0, rollout.mesh=()): allowed "
             "value is 0")

"""The algorithm table: one record per algorithm, read by everything that depends on it.

It sits above the kernels (`arl.algorithms`, which know nothing of configs) and beside
the config schema and the trainers that read it. Validation (`arl.config`), model
construction (a value head or not), the advantage
computation (`arl.trainers.credit_assignment`), the loss (a value term or not) and the update batch
all read the record of `config.algorithm`; none of them compares algorithm names. Adding
an algorithm is one kernel and one row:

    def loo_scaled(batch, settings):               # an outcome-advantage function
        return alg.rloo_advantages(batch.scores, batch.group_ids,
                                   num_groups=batch.num_groups, valid=batch.valid) / 2

    arl.register_algorithm(arl.Algorithm(
        name="rloo_half", credit="outcome", outcome_advantages=loo_scaled,
        min_group_size=2, summary="RLOO at half scale"))
    # config.algorithm = "rloo_half" now validates, builds and trains.

Credit families (how a trajectory becomes token advantages):
  "outcome"      a sequence advantage [B] from the episode scores of each group (GRPO and
                 friends), broadcast over the agent tokens, plus optional process-reward
                 advantages;
  "gae"          token-level (or turn-level) GAE on the rewards with a learned critic;
  "monte_carlo"  VinePPO: turn advantages from Monte Carlo values of forked states.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import struct

from arl import algorithms as alg
from arl.algorithms import group
from arl.errors import invalid_field

CREDIT_FAMILIES = ("outcome", "gae", "monte_carlo")
TRAINERS = ("token", "vector")


@struct.dataclass
class OutcomeBatch:
    """What an outcome-advantage function sees: one score per trajectory and its group."""

    scores: jax.Array  # float32 [B]: the episode's return
    group_ids: jax.Array  # int32 [B]: rows with the same id answered the same task
    env_ids: jax.Array  # int32 [B]: environment (mixture member) of the row
    valid: jax.Array  # bool [B]: rows kept by the filters (others get advantage 0)
    num_groups: int = struct.field(pytree_node=False)
    num_envs: int = struct.field(pytree_node=False)


# (batch, settings) -> float32 [B]; `settings` is the config's `advantage` section.
OutcomeAdvantages = Callable[[OutcomeBatch, Any], jax.Array]
# (logp, old_logp, advantages, mask, settings, *, agg, norm) -> (loss, metrics): the
# policy term of the loss; `settings` is the config's `loss` section.
PolicyLoss = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def ppo_policy_loss(logp, old_logp, advantages, mask, settings, *, agg, norm):
    """PPO's clipped token ratio (`alg.policy_loss`): loss.clip_low, clip_high, dual_clip."""
    return alg.policy_loss(logp, old_logp, advantages, mask, clip_low=settings.clip_low,
                           clip_high=settings.clip_high,
                           dual_clip=settings.dual_clip or None, agg=agg, norm=norm)


def gspo_policy_loss(logp, old_logp, advantages, mask, settings, *, agg, norm):
    """GSPO's clipped sequence ratio: loss.gspo_clip_low, gspo_clip_high."""
    return alg.gspo_policy_loss(logp, old_logp, advantages, mask,
                                clip_low=settings.gspo_clip_low,
                                clip_high=settings.gspo_clip_high, agg=agg, norm=norm)


def cispo_policy_loss(logp, old_logp, advantages, mask, settings, *, agg, norm):
    """CISPO's clipped importance weight: loss.cispo_clip_low, cispo_clip_high."""
    return alg.cispo_policy_loss(logp, old_logp, advantages, mask,
                                 clip_low=settings.cispo_clip_low,
                                 clip_high=settings.cispo_clip_high, agg=agg, norm=norm)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One row of the table.

    Attributes:
      name: the value of `config.algorithm`.
      credit: how advantages come from a trajectory, one of `CREDIT_FAMILIES`.
      outcome_advantages: for credit "outcome", the sequence-advantage function.
      critic: the policy has a value head, trained by a value loss (credit "gae").
      min_group_size: smallest `rollout.group_size` the advantages make sense with.
      trainer: which trainer runs it, "token" (multi-turn token envs) or "vector"
        (vector envs with an MLP actor-critic).
      validate: extra checks of a config using this algorithm; raises `ConfigError`.
      policy_loss: the policy term of the token trainer's loss (`PolicyLoss`); PPO's
        clipped token ratio unless the row names another.
      summary: one line for docs and error messages.
    """

    name: str
    credit: str
    outcome_advantages: OutcomeAdvantages | None = None
    critic: bool = False
    min_group_size: int = 1
    trainer: str = "token"
    validate: Callable[[Any], None] | None = None
    policy_loss: PolicyLoss = ppo_policy_loss
    summary: str = ""

    def __post_init__(self):
        if self.credit not in CREDIT_FAMILIES:
            raise ValueError(f"Algorithm {self.name!r}: credit={self.credit!r}; allowed "
                             f"values are {CREDIT_FAMILIES}")
        if self.trainer not in TRAINERS:
            raise ValueError(f"Algorithm {self.name!r}: trainer={self.trainer!r}; allowed "
                             f"values are {TRAINERS}")
        if (self.credit == "outcome") != (self.outcome_advantages is not None):
            raise ValueError(f"Algorithm {self.name!r}: outcome_advantages is required for "
                             "credit 'outcome' and only for it")
        if self.critic != (self.credit == "gae"):
            raise ValueError(f"Algorithm {self.name!r}: critic=True goes with credit 'gae'")


_TABLE: dict[str, Algorithm] = {}


def _same_definition(a, b) -> bool:
    """Equal values, or functions/classes defined by the same code (a module or a
    notebook cell run again)."""
    if a == b:
        return True
    return (callable(a) and callable(b)
            and getattr(a, "__module__", None) == getattr(b, "__module__", None)
            and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None))


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Adds a row. Registering the same row again (e.g. its module re-imported) replaces
    it; a different row under a taken name is an error."""
    existing = _TABLE.get(algorithm.name)
    if existing is not None and not all(
            _same_definition(getattr(existing, f.name), getattr(algorithm, f.name))
            for f in dataclasses.fields(Algorithm)):
        raise ValueError(f"algorithm {algorithm.name!r} is already registered with a "
                         "different definition")
    _TABLE[algorithm.name] = algorithm
    return algorithm


def algorithm_names(trainer: str | None = None) -> tuple[str, ...]:
    """Registered names in registration order (those of one `trainer` if given)."""
    return tuple(n for n, a in _TABLE.items() if trainer is None or a.trainer == trainer)


def get_algorithm(name: str) -> Algorithm:
    """The row of `name`; `ConfigError` naming `config.algorithm` if there is none."""
    if name not in _TABLE:
        raise invalid_field("algorithm", name, f"allowed values are {algorithm_names()}")
    return _TABLE[name]


# ---------------------------------------------------------------------------- rows
def _grpo(batch: OutcomeBatch, settings) -> jax.Array:
    return group.group_advantages(batch.scores, batch.group_ids, num_groups=batch.num_groups,
                                  scale_by_std=True, eps=settings.eps, valid=batch.valid)


def _drgrpo(batch: OutcomeBatch, settings) -> jax.Array:
    return group.group_advantages(batch.scores, batch.group_ids, num_groups=batch.num_groups,
                                  scale_by_std=False, eps=settings.eps, valid=batch.valid)


def _rloo(batch: OutcomeBatch, settings) -> jax.Array:
    del settings
    return group.rloo_advantages(batch.scores, batch.group_ids, num_groups=batch.num_groups,
                                 valid=batch.valid)


def _reinforce_pp(batch: OutcomeBatch, settings) -> jax.Array:
    del settings
    return group.reinforce_pp_advantages(batch.scores, batch.group_ids,
                                         num_groups=batch.num_groups, valid=batch.valid)


def _erpo(batch: OutcomeBatch, settings) -> jax.Array:
    return group.env_advantages(batch.scores, batch.group_ids, batch.env_ids,
                                num_groups=batch.num_groups, num_envs=batch.num_envs,
                                eps=settings.eps, valid=batch.valid,
                                centre_on_env_mean=settings.erpo_centre_on_env_mean)


def _validate_vineppo(config) -> None:
    p = config.process
    if p.mc_samples < 1:
        raise invalid_field("process.mc_samples", p.mc_samples,
                            "algorithm 'vineppo' estimates values by Monte Carlo: need >= 1")
    if p.reward_weight or p.prm_weight or p.implicit_coef or config.loss.kl_in_reward:
        raise invalid_field(
            "algorithm", config.algorithm,
            "'vineppo' values estimate the environment reward only: set "
            "process.reward_weight, process.prm_weight, process.implicit_coef to 0 "
            "and loss.kl_in_reward to False")
    if p.mc_estimate != "mean_return":
        raise invalid_field("process.mc_estimate", p.mc_estimate,
                            "'vineppo' baselines returns: use 'mean_return'")


def _validate_clip_range(config, prefix: str) -> None:
    """loss.<prefix>_clip_low in (0, 1] and loss.<prefix>_clip_high > 0, finite; no
    dual clip (it bounds PPO's token ratio, which this loss does not use)."""
    for side, high in (("low", 1.0), ("high", None)):
        field = f"loss.{prefix}_clip_{side}"
        value = config.loss[f"{prefix}_clip_{side}"]
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not 0.0 < value < float("inf") or (high is not None and value > high)):
            raise invalid_field(field, value, "expected a finite number in (0, 1]"
                                if high is not None else "expected a finite number > 0")
    if config.loss.dual_clip:
        raise invalid_field("loss.dual_clip", config.loss.dual_clip,
                            f"algorithm {config.algorithm!r} has no token ratio to dual-"
                            "clip: set 0")


def _validate_gspo(config) -> None:
    _validate_clip_range(config, "gspo")


def _validate_cispo(config) -> None:
    _validate_clip_range(config, "cispo")


for _row in (
        Algorithm("ppo", credit="gae", critic=True,
                  summary="PPO with a learned critic: token- or turn-level GAE"),
        Algorithm("grpo", credit="outcome", outcome_advantages=_grpo, min_group_size=2,
                  summary="GRPO: (s - mean_group) / (std_group + eps)"),
        Algorithm("drgrpo", credit="outcome", outcome_advantages=_drgrpo, min_group_size=2,
                  summary="Dr.GRPO: s - mean_group, no division by the std"),
        Algorithm("rloo", credit="outcome", outcome_advantages=_rloo, min_group_size=2,
                  summary="RLOO: s - mean of the other members of the group"),
        Algorithm("reinforce_pp", credit="outcome", outcome_advantages=_reinforce_pp,
                  summary="REINFORCE++-baseline: whiten(s - mean_group) over the batch"),
        Algorithm("erpo", credit="outcome", outcome_advantages=_erpo, min_group_size=2,
                  summary="ERPO: (s - mean_group) / (std over the environment + eps)"),
        Algorithm("vineppo", credit="monte_carlo", validate=_validate_vineppo,
                  summary="VinePPO: turn advantages from Monte Carlo values of forked "
                          "states"),
        Algorithm("gspo", credit="outcome", outcome_advantages=_grpo, min_group_size=2,
                  policy_loss=gspo_policy_loss,
                  validate=_validate_gspo,
                  summary="GSPO: GRPO advantages, PPO clip of the sequence-level ratio"),
        Algorithm("cispo", credit="outcome", outcome_advantages=_grpo, min_group_size=2,
                  policy_loss=cispo_policy_loss,
                  validate=_validate_cispo,
                  summary="CISPO: GRPO advantages, clipped stop-gradient importance "
                          "weight"),
        Algorithm("ppo_vector", credit="gae", critic=True, trainer="vector",
                  summary="PureJaxRL-style PPO on vector (gymnax) environments"),
):
    register_algorithm(_row)
del _row

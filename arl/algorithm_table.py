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

The policy loss is a choice of its own (`config.loss.policy_loss`: "ppo", "gspo",
"cispo" or one added with `register_policy_loss`), beside the row's advantage estimator:
any estimator trains with any policy loss. "auto" (the default) takes the loss the row
presets (`Algorithm.policy_loss`: "ppo" except the presets `gspo` and `cispo`, GRPO's
advantages with those losses). One set of clip settings serves every loss:
`loss.clip_low` / `clip_high`, where 0 means the chosen loss's own default.

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
# policy term of the loss; `settings` is a `ClipSettings`.
PolicyLossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@struct.dataclass
class ClipSettings:
    """The clip settings a policy loss reads: `loss.clip_low` / `clip_high` with 0
    resolved to the loss's own default, and `loss.dual_clip` (0: off)."""

    clip_low: float = struct.field(pytree_node=False)
    clip_high: float = struct.field(pytree_node=False)
    dual_clip: float = struct.field(pytree_node=False, default=0.0)


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """One policy loss, a choice of its own (`config.loss.policy_loss`) beside the
    advantage estimator (`config.algorithm`'s row): any estimator pairs with any loss.

    Attributes:
      name: the value of `config.loss.policy_loss`.
      fn: `(logp, old_logp, advantages, mask, ClipSettings, *, agg, norm) -> (loss,
        metrics)`.
      clip_low, clip_high: the defaults of `loss.clip_low` / `clip_high` for this loss
        (those keys at 0 mean these).
      dual_clip: whether `loss.dual_clip` applies (a bound on a token ratio's loss).
      summary: one line for docs and error messages.
    """

    name: str
    fn: PolicyLossFn
    clip_low: float
    clip_high: float
    dual_clip: bool = False
    summary: str = ""

    def clips(self, loss_settings) -> ClipSettings:
        """The config's `loss` section's clip settings, 0 read as this loss's default."""
        return ClipSettings(clip_low=float(loss_settings.clip_low or self.clip_low),
                            clip_high=float(loss_settings.clip_high or self.clip_high),
                            dual_clip=float(loss_settings.dual_clip))


def ppo_policy_loss(logp, old_logp, advantages, mask, settings, *, agg, norm):
    """PPO's clipped token ratio (`alg.policy_loss`): clip_low, clip_high, dual_clip."""
    return alg.policy_loss(logp, old_logp, advantages, mask, clip_low=settings.clip_low,
                           clip_high=settings.clip_high,
                           dual_clip=settings.dual_clip or None, agg=agg, norm=norm)


def gspo_policy_loss(logp, old_logp, advantages, mask, settings, *, agg, norm):
    """GSPO's clipped sequence ratio (`alg.gspo_policy_loss`): clip_low, clip_high."""
    return alg.gspo_policy_loss(logp, old_logp, advantages, mask,
                                clip_low=settings.clip_low,
                                clip_high=settings.clip_high, agg=agg, norm=norm)


def cispo_policy_loss(logp, old_logp, advantages, mask, settings, *, agg, norm):
    """CISPO's clipped importance weight (`alg.cispo_policy_loss`): clip_low, clip_high."""
    return alg.cispo_policy_loss(logp, old_logp, advantages, mask,
                                 clip_low=settings.clip_low,
                                 clip_high=settings.clip_high, agg=agg, norm=norm)


_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(policy_loss: PolicyLoss) -> PolicyLoss:
    """Adds a policy loss; the same definition again replaces it, a different one under a
    taken name is an error."""
    return _register(_POLICY_LOSSES, policy_loss, "policy loss")


def policy_loss_names() -> tuple[str, ...]:
    """Registered policy losses, in registration order."""
    return tuple(_POLICY_LOSSES)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss `name`; `ConfigError` naming `config.loss.policy_loss` if none."""
    if name not in _POLICY_LOSSES:
        raise invalid_field("loss.policy_loss", name,
                            f"allowed values are {('auto',) + policy_loss_names()}")
    return _POLICY_LOSSES[name]


def chosen_policy_loss(config) -> PolicyLoss:
    """The policy loss a config trains with: `loss.policy_loss`, or with "auto" the one
    its algorithm's row presets."""
    name = config.loss.policy_loss
    if name == "auto":
        name = get_algorithm(config.algorithm).policy_loss
    return get_policy_loss(name)


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
      policy_loss: the name of the policy loss the row presets (`loss.policy_loss =
        "auto"`); PPO's clipped token ratio unless the row names another.
      summary: one line for docs and error messages.
    """

    name: str
    credit: str
    outcome_advantages: OutcomeAdvantages | None = None
    critic: bool = False
    min_group_size: int = 1
    trainer: str = "token"
    validate: Callable[[Any], None] | None = None
    policy_loss: str = "ppo"
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
        if not isinstance(self.policy_loss, str):
            raise ValueError(f"Algorithm {self.name!r}: policy_loss={self.policy_loss!r}; "
                             "name a registered policy loss (register_policy_loss)")


_TABLE: dict[str, Algorithm] = {}


def _same_definition(a, b) -> bool:
    """Equal values, or functions/classes defined by the same code (a module or a
    notebook cell run again)."""
    if a == b:
        return True
    return (callable(a) and callable(b)
            and getattr(a, "__module__", None) == getattr(b, "__module__", None)
            and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None))


def _register(table: dict, entry, kind: str):
    """Puts a dataclass `entry` (an `Algorithm`, a `PolicyLoss`) in `table` under its
    name: the same definition again replaces it, a different one under a taken name is a
    ValueError naming the `kind`."""
    existing = table.get(entry.name)
    if existing is not None and not all(
            _same_definition(getattr(existing, f.name), getattr(entry, f.name))
            for f in dataclasses.fields(entry)):
        raise ValueError(f"{kind} {entry.name!r} is already registered with a "
                         "different definition")
    table[entry.name] = entry
    return entry


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Adds a row. Registering the same row again (e.g. its module re-imported) replaces
    it; a different row under a taken name is an error."""
    return _register(_TABLE, algorithm, "algorithm")


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
                  policy_loss="gspo",
                  summary="GSPO (a preset): GRPO advantages, policy loss 'gspo'"),
        Algorithm("cispo", credit="outcome", outcome_advantages=_grpo, min_group_size=2,
                  policy_loss="cispo",
                  summary="CISPO (a preset): GRPO advantages, policy loss 'cispo'"),
        Algorithm("ppo_vector", credit="gae", critic=True, trainer="vector",
                  summary="PureJaxRL-style PPO on vector (gymnax) environments"),
):
    register_algorithm(_row)
del _row

for _loss in (
        PolicyLoss("ppo", ppo_policy_loss, clip_low=0.2, clip_high=0.2, dual_clip=True,
                   summary="PPO's clipped token ratio (optionally dual-clipped)"),
        # The paper's 3e-4 / 4e-4 (GSPO, arXiv 2507.18071).
        PolicyLoss("gspo", gspo_policy_loss, clip_low=3e-4, clip_high=4e-4,
                   summary="GSPO: PPO's clip of the sequence-level ratio"),
        # Low 1.0: no lower bound on the weight (CISPO, arXiv 2506.13585).
        PolicyLoss("cispo", cispo_policy_loss, clip_low=1.0, clip_high=0.28,
                   summary="CISPO: REINFORCE weighted by the clipped, stop-gradient "
                           "importance weight"),
):
    register_policy_loss(_loss)
del _loss

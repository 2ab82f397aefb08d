"""`config.loss`: the policy loss's clipping and aggregation, the value, entropy and KL
terms, and the auxiliary ECHO and SFT terms (arl.algorithms.losses)."""

from __future__ import annotations

import os

import ml_collections

from arl import algorithm_table
from arl import algorithms as alg
from arl.config.checks import check_choice, check_range, fail
from arl.envs.base import SCRIPTED_SOURCES as SFT_SOURCES


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # The policy term (arl.algorithm_table): "ppo" (clipped token ratio), "gspo"
    # (clipped sequence ratio), "cispo" (clipped importance weight), or "auto": the one
    # `algorithm` presets ("ppo" except the presets "gspo" and "cispo").
    c.policy_loss = "auto"
    # The chosen policy loss's clip range; 0 = that loss's default (ppo 0.2 / 0.2, gspo
    # 3e-4 / 4e-4, cispo 1.0 / 0.28).
    c.clip_low = 0.0
    c.clip_high = 0.0
    c.dual_clip = 0.0  # ppo only; 0 disables; e.g. 3.0
    c.agg = "token-mean"
    c.norm = 0.0  # constant N for seq-mean-token-sum-norm; 0 = the context length
    c.value_coef = 0.5
    c.value_clip = 0.0  # 0 disables
    c.entropy_coef = 0.0
    c.kl_coef = 0.0
    c.kl_kind = "k3"
    c.kl_in_reward = False
    c.echo_coef = 0.0  # ECHO: cross-entropy on environment observation tokens
    c.sft_coef = 0.0  # RL + alpha * SFT on demonstrations
    c.sft_coef_final = -1.0  # < 0: constant sft_coef; else linear decay to this value
    c.sft_hold_steps = 0
    c.sft_decay_steps = 100
    c.sft_source = "demonstrator"
    # Path of a demonstration set written by `arl.rollout.build_demonstrations`; empty
    # means demonstrations are generated on the fly by `sft_source` inside the step.
    c.sft_dataset = ""
    # Off-policy correction (arl.algorithms.off_policy, checked in arl.config.off_policy):
    # "none" (synchronous), "bypass", "tis", "icepop", "decoupled"; the weight's level
    # (decoupled), cap C (tis, decoupled) and icepop's [low, high].
    c.off_policy_correction = "none"
    c.off_policy_level = "token"
    c.off_policy_cap = 2.0
    c.off_policy_low = 0.5
    c.off_policy_high = 2.0
    return c


# Keys since replaced, with what replaces them (a config that sets one gets this error).
RETIRED_KEYS = {
    f"loss.{loss}_clip_{side}": (f"loss.clip_{side} with loss.policy_loss='{loss}' (or "
                                 f"algorithm '{loss}'); 0 means {loss}'s default")
    for loss in ("gspo", "cispo") for side in ("low", "high")}


def validate(config) -> None:
    loss = config.loss
    check_choice(config, "loss.policy_loss",
                 ("auto",) + algorithm_table.policy_loss_names())
    chosen = algorithm_table.chosen_policy_loss(config)
    if algorithm_table.get_algorithm(config.algorithm).trainer == "vector" \
            and chosen.name != "ppo":
        fail("loss.policy_loss", loss.policy_loss,
             f"algorithm {config.algorithm!r} (VectorPPO) trains with 'ppo' only")
    check_range(config, "loss.clip_low", 0.0, 1.0)  # 0: the policy loss's default
    check_range(config, "loss.clip_high", 0.0)
    if loss.dual_clip != 0.0:
        if not chosen.dual_clip:
            fail("loss.dual_clip", loss.dual_clip,
                 f"policy loss {chosen.name!r} has no token ratio to dual-clip: set 0")
        check_range(config, "loss.dual_clip", 1.0, low_open=True)
    check_choice(config, "loss.agg", alg.AGGREGATIONS)
    if loss.norm and loss.agg != "seq-mean-token-sum-norm":
        fail("loss.norm", loss.norm,
             "a constant normaliser only applies to loss.agg='seq-mean-token-sum-norm'")
    check_choice(config, "loss.kl_kind", alg.KL_KINDS)
    for field in ("value_coef", "value_clip", "entropy_coef", "kl_coef", "echo_coef",
                  "sft_coef", "norm"):
        check_range(config, f"loss.{field}", 0.0)
    check_choice(config, "loss.sft_source", SFT_SOURCES)
    if not isinstance(loss.sft_dataset, str):
        fail("loss.sft_dataset", loss.sft_dataset, "expected a path (str); empty = on the fly")
    if loss.sft_dataset and not os.path.isdir(loss.sft_dataset):
        fail("loss.sft_dataset", loss.sft_dataset,
             "no such directory; write one with arl.rollout.build_demonstrations")
    check_range(config, "loss.sft_hold_steps", 0, integer=True)
    check_range(config, "loss.sft_decay_steps", 1, integer=True)

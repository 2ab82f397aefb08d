"""`config.updates`: the update phase's epochs x minibatches, how rows are dealt into
minibatches, and what the token trainer's update may take from the rollout."""

from __future__ import annotations

import ml_collections

from arl.config.checks import check_bool, check_choice, check_range, fail

MINIBATCH_SHUFFLES = ("rows", "groups")  # updates.shuffle


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.epochs = 1
    c.minibatches = 1
    # Token trainer: read each group's shared prompt once in the update (with one
    # minibatch, or with minibatches of whole groups).
    c.share_group_prompt = True
    # How an epoch deals rows into minibatches: "rows" shuffles the rows; "groups" (token
    # trainer) shuffles whole groups, so each minibatch holds complete groups.
    c.shuffle = "rows"
    # Token trainer: the update's forward pass takes every layer's projection outputs
    # from the rollout (recorded while decoding at the same parameters) instead of
    # recomputing them; needs epochs = minibatches = 1 (the only update step at the
    # rollout's parameters). Memory: layers x rows x context x the projections' widths.
    c.reuse_rollout_activations = False
    return c


def validate(config) -> None:
    u = config.updates
    check_range(config, "updates.epochs", 1, integer=True)
    check_range(config, "updates.minibatches", 1, integer=True)
    check_bool(config, "updates.share_group_prompt")
    check_choice(config, "updates.shuffle", MINIBATCH_SHUFFLES)
    check_bool(config, "updates.reuse_rollout_activations")
    if u.reuse_rollout_activations and (u.epochs != 1 or u.minibatches != 1):
        fail("updates.reuse_rollout_activations", u.reuse_rollout_activations,
             f"needs updates.epochs = 1 and updates.minibatches = 1 (the one update step "
             f"at the rollout's parameters), got epochs={u.epochs}, "
             f"minibatches={u.minibatches}")

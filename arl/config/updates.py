"""`config.updates`: the update phase's epochs x minibatches, how rows are dealt into
minibatches, and what the token trainer's update may take from the rollout
(`reuses_rollout_activations`: where the reuse of the rollout's activations is on)."""

from __future__ import annotations

import ml_collections

from arl import algorithm_table
from arl.config.checks import check_bool, check_choice, check_range, fail
from arl.config.off_policy import uses_two_programs

MINIBATCH_SHUFFLES = ("rows", "groups")  # updates.shuffle
REUSE_AUTO = "auto"  # updates.reuse_rollout_activations: on exactly where it can be
REUSE_SETTINGS = (REUSE_AUTO, True, False)


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
    # recomputing them (docs/performance.md, "Reusing the rollout's activations").
    # "auto" (default): on exactly where it is valid and saves time, as
    # `reuses_rollout_activations` decides (one update step at the rollout's parameters,
    # the fused step, no model.remat); True: on (a one-line error where invalid); False:
    # off. Memory: layers x rows x context x (q + k + v + o + gate + up + down widths)
    # values in model.dtype, held from the rollout to the end of the update: 58 MiB for
    # default_config() (2 x 128 x 71 x 832 float32), 432 MiB at the peers' modest
    # setting (4 layers x 128 rows x 72 tokens x 3072). A field of type object (it holds
    # "auto" or a bool), so --config.updates.reuse_rollout_activations=False parses as
    # the bool.
    c.reuse_rollout_activations = ml_collections.FieldReference(REUSE_AUTO,
                                                                field_type=object)
    return c


def reuse_unavailable(config) -> str | None:
    """Why the trainer of `config` cannot take the update's projections from its rollout
    (None: it can): only the token trainer's rollout records them, only an update whose
    one step is at the rollout's parameters may take them, and only the fused step has
    them on the update's side."""
    trainer = algorithm_table.get_algorithm(config.algorithm).trainer
    u = config.updates
    if trainer != "token":
        return f"the {trainer} trainer's model keeps no rollout activations"
    if u.epochs != 1 or u.minibatches != 1:
        return (f"needs updates.epochs = 1 and updates.minibatches = 1 (the one update "
                f"step at the rollout's parameters), got epochs={u.epochs}, "
                f"minibatches={u.minibatches}")
    if uses_two_programs(config):
        return ("the rollout's activations stay on the rollout's side with "
                "rollout.policy_lag > 0 or a rollout.mesh")
    if config.rollout.get("schedule", "lockstep") == "slots":
        return "a slot-scheduled rollout (rollout.schedule='slots') records none"
    return None


def reuses_rollout_activations(config) -> bool:
    """Whether the token trainer's update takes the rollout's recorded projection outputs
    (`updates.reuse_rollout_activations` resolved): True / False as set; "auto" is True
    exactly where `reuse_unavailable` finds nothing and `model.remat` is off (with
    rematerialisation the update keeps only each layer's input, and the recorded buffers
    would undo that memory saving)."""
    setting = config.updates.reuse_rollout_activations
    if setting != REUSE_AUTO:
        return bool(setting)
    return reuse_unavailable(config) is None and not config.model.remat


def validate(config) -> None:
    check_range(config, "updates.epochs", 1, integer=True)
    check_range(config, "updates.minibatches", 1, integer=True)
    check_bool(config, "updates.share_group_prompt")
    check_choice(config, "updates.shuffle", MINIBATCH_SHUFFLES)
    setting = config.updates.reuse_rollout_activations
    if not (setting == REUSE_AUTO or isinstance(setting, bool)):
        fail("updates.reuse_rollout_activations", setting,
             f"allowed values are {REUSE_SETTINGS}")


def validate_reuse(config) -> None:
    """An explicit `updates.reuse_rollout_activations = True` where the trainer cannot
    reuse the rollout's activations (after the rollout's and off-policy keys' checks,
    which `reuse_unavailable` reads); "auto" is then off, never an error."""
    if config.updates.reuse_rollout_activations is not True:
        return
    why = reuse_unavailable(config)
    if why is not None:
        fail("updates.reuse_rollout_activations", True,
             f"{why}: allowed values are {(REUSE_AUTO, False)}")

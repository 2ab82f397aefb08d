"""`config.rollout.history` and its window: how a multi-turn conversation becomes the
policy's context (docs/checkpoints.md, "History modes"), checked early in one line each.

* "as_generated": one growing token sequence of what the policy wrote and the env's
  replies, checked at construction to equal apply_chat_template of the checkpoint's
  template or of its keep-history variant (Qwen3's);
* "per_turn": before every turn the conversation so far is rendered afresh with the
  checkpoint's own template and prefilled; each turn is one training sample that takes
  its episode's credit (`arl.rollout.per_turn`, `arl.trainers.per_turn`). It trains
  outcome-credit algorithms (GRPO and its relatives) and GAE ones (PPO, token- or
  turn-level) with a checkpoint's chat template;
  what it does not combine with yet is refused below, naming the key.
"""

from __future__ import annotations

from arl.config.checks import check_range, fail

HISTORY_MODES = ("as_generated", "per_turn")

# (key, is it switched on?, what it needs): what per-turn mode does not combine with yet.
_PER_TURN_EXCLUDES = (
    ("process.reward_weight", lambda v: v > 0, "per-token process rewards"),
    ("process.prm_weight", lambda v: v > 0, "a process reward model"),
    ("process.train_prm", bool, "a process reward model"),
    ("process.implicit_coef", lambda v: v > 0, "PRIME's implicit rewards"),
    ("process.mc_samples", lambda v: v > 0, "Monte Carlo branching"),
    ("loss.kl_in_reward", bool, "per-token rewards"),
    ("loss.echo_coef", lambda v: v > 0, "observation tokens in the growing context"),
    ("loss.sft_coef", lambda v: v > 0, "demonstrations in the growing context"),
    ("reward.functions", bool, "Python reward functions on the growing context"),
    ("reward_model.hf_checkpoint", bool, "a reward model on the growing context"),
    ("rollout.policy_lag", lambda v: v > 0, "the fused one-program step"),
    ("rollout.mesh", lambda v: bool(tuple(v)), "the fused one-program step"),
    ("updates.reuse_rollout_activations", lambda v: v is True,
     "one recorded context per row"),
    ("rollout.schedule", lambda v: v == "slots", "lockstep turns"),
)


def add_defaults(c) -> None:
    """The history keys of `config.rollout`."""
    c.history = "as_generated"
    # A history window for per_turn (both 0: the whole conversation): keep the system
    # prompt, the task and only the last `history_window_turns` exchanges (assistant turn
    # + reply), and drop the oldest ones until the context has at most
    # `history_window_tokens` tokens; episodes longer than the context then run.
    c.history_window_turns = 0
    c.history_window_tokens = 0


def _value(config, field):
    node = config
    for part in field.split("."):
        if part not in node:
            return None
        node = node[part]
    return node


def validate(config, algorithm) -> None:
    r = config.rollout
    if r.history not in HISTORY_MODES:
        fail("rollout.history", r.history, f"allowed values are {HISTORY_MODES}")
    check_range(config, "rollout.history_window_turns", 0, integer=True)
    check_range(config, "rollout.history_window_tokens", 0, integer=True)
    if r.history != "per_turn":
        for field in ("history_window_turns", "history_window_tokens"):
            if r[field]:
                fail(f"rollout.{field}", r[field],
                     "a history window needs rollout.history='per_turn' (as generated, "
                     "the context is the whole conversation): set it to 0")
        return
    if algorithm.credit not in ("outcome", "gae"):
        fail("rollout.history", r.history,
             f"per_turn trains outcome-credit algorithms (e.g. grpo, rloo) and GAE ones "
             f"(ppo); algorithm {config.algorithm!r} has credit {algorithm.credit!r}: use "
             "rollout.history='as_generated'")
    if not config.model.hf_checkpoint:
        fail("rollout.history", r.history,
             "per_turn renders every context with a checkpoint's chat template: set "
             "model.hf_checkpoint")
    for field, switched_on, needs in _PER_TURN_EXCLUDES:
        value = _value(config, field)
        if value is not None and switched_on(value):
            fail(field, value, f"not available with rollout.history='per_turn' (it needs "
                               f"{needs}): use rollout.history='as_generated'")

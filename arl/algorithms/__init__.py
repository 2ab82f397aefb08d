"""Pure-function kernels of agentic RL: advantages, group statistics, losses, filters.

Conventions (docs/kernels.md): token arrays are `[B, T]`, sequence arrays `[B]`, `mask` is
the agent mask. Every kernel is jittable and vmappable, computes statistics in float32,
returns no NaN on degenerate input and zeros its outputs where the mask is 0.

The package stands alone: it imports jax, chex and numpy only, so its kernels compose
into any JAX code (examples/compose_kernels.py). No kernel compiles itself: called
outside a trace it runs op by op, like any `jax.numpy` function; `jax.jit` the function
that calls it. The algorithm table that names these kernels in a config lives a layer
up, in `arl.algorithm_table`.
"""

from arl.algorithms.advantages import GAE_METHODS, discounted_returns, gae, turn_level_gae
from arl.algorithms.aggregation import AGGREGATIONS, aggregate
from arl.algorithms.filters import dapo_zero_variance_mask, horizon_schedule, starpo_keep_mask
from arl.algorithms.group import (GroupStatistics, env_advantages, group_advantages,
                                  group_statistics, reinforce_pp_advantages,
                                  rloo_advantages)
from arl.algorithms.logprobs import entropy, token_logprobs, token_logprobs_and_entropy
from arl.algorithms.losses import (KL_KINDS, kl_penalty, nll_per_token, observation_loss,
                                   policy_loss, policy_loss_per_token, sft_loss, value_loss,
                                   value_loss_per_token)
from arl.algorithms.normalization import whiten
from arl.algorithms.off_policy import (CORRECTIONS, WEIGHT_LEVELS,
                                       decoupled_policy_loss_per_token,
                                       importance_log_weights, off_policy_weights,
                                       weighted_advantages)
from arl.algorithms.policy_losses import (cispo_policy_loss, cispo_policy_loss_per_token,
                                          gspo_policy_loss, gspo_policy_loss_per_token)
from arl.algorithms.process import (MC_ESTIMATES, monte_carlo_values, process_advantages,
                                    tokens_to_turns, turn_ids, turns_to_tokens,
                                    vine_advantages)

__all__ = [
    "CORRECTIONS", "WEIGHT_LEVELS", "decoupled_policy_loss_per_token",
    "importance_log_weights", "off_policy_weights", "weighted_advantages",
    "AGGREGATIONS", "GAE_METHODS", "MC_ESTIMATES", "monte_carlo_values", "GroupStatistics", "KL_KINDS", "aggregate",
    "cispo_policy_loss", "cispo_policy_loss_per_token", "dapo_zero_variance_mask", "discounted_returns", "entropy", "env_advantages", "gae",
    "group_advantages", "group_statistics", "gspo_policy_loss",
    "gspo_policy_loss_per_token", "horizon_schedule", "kl_penalty",
    "nll_per_token", "observation_loss", "policy_loss", "policy_loss_per_token",
    "process_advantages", "reinforce_pp_advantages", "rloo_advantages", "sft_loss", "starpo_keep_mask",
    "token_logprobs", "token_logprobs_and_entropy", "tokens_to_turns", "turn_ids",
    "turn_level_gae", "turns_to_tokens",
    "value_loss", "value_loss_per_token", "vine_advantages", "whiten",
]

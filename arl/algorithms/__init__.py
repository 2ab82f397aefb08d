"""Pure-function kernels of agentic RL: advantages, group statistics, losses, filters,
and the algorithm table.

Conventions (docs/kernels.md): token arrays are `[B, T]`, sequence arrays `[B]`, `mask` is
the agent mask. Every kernel is jittable and vmappable, computes statistics in float32,
returns no NaN on degenerate input and zeros its outputs where the mask is 0.
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
from arl.algorithms.process import (process_advantages, tokens_to_turns, turn_ids,
                                    turns_to_tokens, vine_advantages)
from arl.algorithms.table import (CREDIT_FAMILIES, Algorithm, OutcomeBatch, algorithm_names,
                                  get_algorithm, register_algorithm)

__all__ = [
    "AGGREGATIONS", "Algorithm", "CORRECTIONS", "CREDIT_FAMILIES", "WEIGHT_LEVELS",
    "decoupled_policy_loss_per_token", "importance_log_weights", "off_policy_weights",
    "weighted_advantages", "OutcomeBatch", "algorithm_names",
    "get_algorithm", "register_algorithm", "GAE_METHODS", "GroupStatistics", "KL_KINDS", "aggregate",
    "dapo_zero_variance_mask", "discounted_returns", "entropy", "env_advantages", "gae",
    "group_advantages", "group_statistics", "horizon_schedule", "kl_penalty",
    "nll_per_token", "observation_loss", "policy_loss", "policy_loss_per_token",
    "process_advantages", "reinforce_pp_advantages", "rloo_advantages", "sft_loss", "starpo_keep_mask",
    "token_logprobs", "token_logprobs_and_entropy", "tokens_to_turns", "turn_ids",
    "turn_level_gae", "turns_to_tokens",
    "value_loss", "value_loss_per_token", "vine_advantages", "whiten",
]

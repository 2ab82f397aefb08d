"""Flax models (decoder LM with optional value head, MLP actor-critics) and sampling."""

from arl.models.mlp import ActorCritic, GaussianActorCritic
from arl.models.sampling import (GenerateOutput, generate, sample_from_logits, take_last_valid,
                                 truncation_mask)
from arl.models.transformer import (LOGICAL_AXIS_RULES, KVCache, ModelOutput, Transformer,
                                    TransformerConfig, abstract_params, apply_rope, init_cache,
                                    output_matrix, param_partition_specs, param_shardings,
                                    unembedding_matrix)

__all__ = [
    "ActorCritic", "GaussianActorCritic", "GenerateOutput", "generate", "sample_from_logits",
    "take_last_valid", "truncation_mask", "LOGICAL_AXIS_RULES", "KVCache", "ModelOutput",
    "Transformer", "TransformerConfig", "abstract_params", "apply_rope", "init_cache",
    "output_matrix", "param_partition_specs", "param_shardings", "unembedding_matrix",
]

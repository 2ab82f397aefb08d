"""One decoder layer: pre-norm attention and SwiGLU MLP, each added to the residual
stream (`arl.models.transformer` has the formulas)."""

from __future__ import annotations

import flax.linen as nn

from arl.models.attention import Attention
from arl.models.layers import RMSNorm, SwiGLU
from arl.models.partitioning import RESIDUAL, constrain_activation
from arl.models.transformer_config import TransformerConfig


class DecoderLayer(nn.Module):
    """One pre-norm layer; scanned over the layer axis (carry = the residual stream and
    the whole KV cache, which each layer updates in place at its `layer_index`; scanned
    inputs: the layer's `prefix_kv` and its recorded projection outputs `stored`, each
    or None). Its per-layer output is (the (keys, values) of a cache-free call's tokens
    with `return_kv`, else None; the projections' outputs {name: [B, T, *features]}
    with `return_projections`, else None)."""

    config: TransformerConfig
    return_kv: bool = False
    return_projections: bool = False

    @nn.compact
    def __call__(self, carry, layer_index, prefix_kv, stored, positions, rope,
                 write_positions, key_positions, attend, key_mask, query_slots):
        cfg = self.config
        h, cache_kv = carry
        h = constrain_activation(h, RESIDUAL)
        norm = lambda name: RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name=name)
        attn_out, new_kv, produced = Attention(cfg, name="self_attn")(
            norm("input_layernorm")(h), positions, rope, cache_kv, layer_index,
            write_positions, key_positions, attend, key_mask, query_slots, prefix_kv, stored)
        token_kv = None
        if cache_kv is None:
            token_kv = new_kv if self.return_kv else None
        else:
            cache_kv = new_kv
        h = constrain_activation(h + attn_out, RESIDUAL)
        mlp_out, mlp_produced = SwiGLU(cfg, name="mlp")(norm("post_attention_layernorm")(h),
                                                        stored)
        h = h + mlp_out
        produced = {**produced, **mlp_produced} if self.return_projections else None
        return (constrain_activation(h, RESIDUAL), cache_kv), (token_kv, produced)

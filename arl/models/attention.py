"""The decoder's self-attention layer: q/k/v projections, RoPE, grouped-query attention
over the call's tokens or a KV cache, and the output projection.

    out = o_proj(softmax(RoPE(q_proj x) RoPE(k_proj x)^T / sqrt(head_dim) + mask) v_proj x)

Scores and softmax are float32; num_heads query heads share num_kv_heads key/value heads
in groups (GQA, Ainslie et al. 2023, arXiv 2305.13245). One layer, five ways to attend:

* dense over the T tokens (training, scoring; a [B, H, T, T] score tensor);
* tiled over the T tokens (`config.attention` "blocked" or "cudnn" for T tokens:
  `attention_kernels.causal_self_attention`, memory linear in T);
* after a prefix: T tokens continuing P given positions' keys and values, differentiable;
* on a stacked KV cache ([L, B, S, KV, Dh], updated in place at this layer's index);
* on one layer's buffers of a per-layer cache (read and written as stored).

The kernels (the tiled and cached attention, the products in each cache layout) are in
`arl.models.attention_kernels`; their names are re-exported here.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from arl.models import attention_kernels as kernels
from arl.models.attention_kernels import (IMPLEMENTATIONS, block_layout, cached_attention,
                                          causal_self_attention, grouped_mix, grouped_scores,
                                          layer_mix, layer_scores, mix_every_head_pair,
                                          resolve_implementation, scores_every_head_pair,
                                          uses_head_pairs)
from arl.models.kv_cache import write_cache, write_layer_cache
from arl.models.layers import RMSNorm
from arl.models.partitioning import HEADS, KV_HEADS, constrain_activation
from arl.models.projections import stored_projection, weight_init
from arl.models.rope import rotate
from arl.models.transformer_config import TransformerConfig

__all__ = [
    "Attention", "IMPLEMENTATIONS", "block_layout", "cached_attention",
    "causal_self_attention", "grouped_mix", "grouped_scores", "layer_mix", "layer_scores",
    "mix_every_head_pair", "resolve_implementation", "scores_every_head_pair",
    "uses_head_pairs",
]


def _qkv_projection(config, features, names, use_bias, name):
    return nn.DenseGeneral(
        features=features, axis=-1, use_bias=use_bias, dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=nn.with_logical_partitioning(weight_init(config), ("embed",) + names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names), name=name)


class Attention(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x, positions, rope, cache_kv, layer_index, write_positions,
                 key_positions, attend, key_mask=None, query_slots=None, prefix_kv=None,
                 stored=None):
        """x [B, T, D]; positions int [B, T] (query positions); rope: their `rope_tables`
        (computed once per forward pass, not in every layer).

        Without a cache (cache_kv None) keys are the T tokens themselves. With a cache
        (every layer's keys, values [L, B, S, KV, Dh]; or this layer's buffers of a
        per-layer cache, keys [B, KV, Dh, S] and values [B, KV, S, Dh], with layer_index
        None) this layer's new keys are scattered
        to `[layer_index, b, write_positions]` (out-of-range entries dropped) and queries
        attend to all S slots of the layer whose position is <= their own
        (`key_positions` [S]). The whole cache is updated in place (a scatter of the T new
        tokens); slicing one layer out and stacking the layers back would copy the cache
        at every decoded token.

        attend: None (the rule above: key position <= query position), or bool
        [B or 1, T, S] saying which keys each query may see (explicit positions or a
        padding mask; built once by `Transformer`).

        Cache-free calls whose `config.attention` resolves to "blocked" or "cudnn" for T
        tokens use `arl.models.attention_kernels.causal_self_attention` instead (causal by
        sequence order, padding keys removed by `key_mask` bool [B, T] or None; `attend`
        is then None). Cached calls whose `config.attention` resolves to "blocked" for
        the S slots (auto: S > attention_block) use
        `arl.models.attention_kernels.cached_attention`, which reads only the blocks up to the
        last query's slot (`query_slots` int [B, T]; the same rule as `attend`).

        prefix_kv: (keys, values) [B, P, KV, Dh] of P positions before the T tokens (a
        cache-free call continuing from them, `_after_prefix`); None otherwise.

        stored: None, or this layer's recorded outputs {name: [B, T, *features]} of
        q/k/v_proj (before RoPE) and o_proj, taken as the projections' forward values
        (`arl.models.projections.StoredProjection`: gradients as the projections').

        Returns (output [B, T, D], the updated cache, the projections' outputs {name:
        [B, T, *features]}) with a cache, (output, (k, v), outputs) with (k, v) the T
        tokens' rotated keys and values ([B, T, KV, Dh]) without one.

        The projections run on the tokens flattened to [B*T, D], like `SwiGLU`.
        """
        cfg = self.config
        num_heads, num_kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        batch, q_len = x.shape[:2]
        tokens = x.reshape(batch * q_len, x.shape[-1])

        produced = {}

        def project(heads, names, name, activation_names):
            if stored is None:
                out = _qkv_projection(cfg, (heads, head_dim), names, cfg.qkv_bias, name)(tokens)
            else:
                out = stored_projection(cfg, (heads, head_dim), 1, ("embed",) + names, names,
                                        cfg.qkv_bias, name)(
                    tokens, stored[name].reshape(batch * q_len, heads, head_dim))
            out = constrain_activation(out.reshape(batch, q_len, heads, head_dim),
                                       activation_names)
            produced[name] = out
            return out

        q = project(num_heads, ("heads", "head_dim"), "q_proj", HEADS)
        k = project(num_kv, ("kv_heads", "head_dim"), "k_proj", KV_HEADS)
        v = project(num_kv, ("kv_heads", "head_dim"), "v_proj", KV_HEADS)
        if cfg.qk_norm:  # Qwen3: every head normalised before RoPE
            q = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, "head_dim", name="q_norm")(q)
            k = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, "head_dim", name="k_norm")(k)
        q = rotate(q, *rope)
        k = rotate(k, *rope)
        out, new_kv = self._attend(q, k, v, positions, cache_kv, layer_index,
                                   write_positions, key_positions, attend, key_mask,
                                   query_slots, prefix_kv)
        out = _output_projection(cfg, constrain_activation(out, HEADS),
                                 None if stored is None else stored["o_proj"])
        produced["o_proj"] = out
        return out, new_kv, produced

    def _attend(self, q, k, v, positions, cache_kv, layer_index, write_positions,
                key_positions, attend, key_mask, query_slots, prefix_kv):
        """The attention of `__call__` on the rotated q, k and v: (output [B, T, H, Dh]
        before o_proj, the updated cache or the tokens' (k, v))."""
        cfg = self.config
        num_heads, num_kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        batch, q_len = q.shape[:2]
        if prefix_kv is not None:
            return self._after_prefix(q, k, v, prefix_kv, positions)
        implementation = kernels.resolve_implementation(cfg.attention, q_len,
                                                              cfg.attention_block)
        if cache_kv is None and implementation != "dense":
            out = kernels.causal_self_attention(
                q, k, v, key_mask, implementation=implementation,
                block_size=cfg.attention_block)
            return out, (k, v)

        if layer_index is None:
            return self._on_layer_cache(q, k, v, cache_kv, positions, write_positions,
                                        key_positions, attend, query_slots)
        new_kv = cache_kv
        if cache_kv is None:
            keys, values = k, v
            key_pos = positions  # [B, T]
            new_kv = (k, v)
        elif kernels.resolve_implementation(
                cfg.attention, cache_kv[0].shape[2], cfg.attention_block) == "blocked":
            all_keys, all_values = write_cache(cache_kv, layer_index, write_positions, k, v)
            out = kernels.cached_attention(
                q, all_keys, all_values, layer_index, query_slots,
                block_size=cfg.attention_block)
            return out, (all_keys, all_values)
        else:
            all_keys, all_values = write_cache(cache_kv, layer_index, write_positions, k, v)
            new_kv = (all_keys, all_values)
            keys = jax.lax.dynamic_index_in_dim(all_keys, layer_index, 0, keepdims=False)
            values = jax.lax.dynamic_index_in_dim(all_values, layer_index, 0, keepdims=False)
            keys, values = keys.astype(cfg.dtype), values.astype(cfg.dtype)
            key_pos = jnp.broadcast_to(key_positions, (batch, key_positions.shape[0]))

        groups = num_heads // num_kv
        q = q.reshape(batch, q_len, num_kv, groups, head_dim)
        # A decoded token on the CPU reads the cache layer as stored, through products over
        # every head pair, instead of a transposed copy of it
        # (`attention_kernels.uses_head_pairs`).
        head_pairs = cache_kv is not None and kernels.uses_head_pairs(q_len)
        scores = kernels.grouped_scores(q, keys, head_pairs=head_pairs) / math.sqrt(
            head_dim)
        probs = _attention_probs(scores, key_pos, positions, attend, cfg.dtype)
        out = kernels.grouped_mix(probs, values, head_pairs=head_pairs).reshape(
            batch, q_len, num_heads, head_dim)
        return out, new_kv

    def _after_prefix(self, q, k, v, prefix_kv, positions):
        """Cache-free attention of T tokens at positions P..P+T-1 over the P given
        keys and values followed by their own, causally: the function a cached call
        continuing from those P positions computes, differentiable in every input (the
        prefix included) with any `config.attention`. Returns (output before o_proj,
        (k, v))."""
        cfg = self.config
        batch, q_len, num_heads, head_dim = q.shape
        prefix_keys, prefix_values = prefix_kv
        prefix_len = prefix_keys.shape[1]
        keys = jnp.concatenate([prefix_keys.astype(cfg.dtype), k], axis=1)
        values = jnp.concatenate([prefix_values.astype(cfg.dtype), v], axis=1)
        implementation = kernels.resolve_implementation(
            cfg.attention, prefix_len + q_len, cfg.attention_block)
        if implementation != "dense":
            # The prefix's positions get zero queries: causality by sequence order then
            # gives each token the prefix and the tokens before it; their outputs are
            # dropped.
            padded = jnp.concatenate(
                [jnp.zeros((batch, prefix_len) + q.shape[2:], q.dtype), q], axis=1)
            out = kernels.causal_self_attention(
                padded, keys, values, None, implementation=implementation,
                block_size=cfg.attention_block)[:, prefix_len:]
        else:
            # In a per-layer cache's layout: the products a cached continuation runs, so
            # a shared prompt scores as it did through the cache (same speed at the
            # peers' modest shape; `[B, S, KV, Dh]` products were not measured apart).
            out = _layer_layout_attention(
                q, keys.transpose(0, 2, 3, 1), values.transpose(0, 2, 1, 3),
                jnp.arange(prefix_len + q_len, dtype=jnp.int32), positions, None, cfg.dtype)
        return out, (k, v)

    def _on_layer_cache(self, q, k, v, layer_cache, positions, write_positions,
                        key_positions, attend, query_slots):
        """The cached attention of `__call__` on one layer's buffers of a per-layer cache
        (keys [B, KV, Dh, S], values [B, KV, S, Dh]): the same function, with products
        that read the buffers as stored. Returns (output before o_proj, the buffers)."""
        cfg = self.config
        keys, values = write_layer_cache(layer_cache, write_positions, k, v)
        capacity = keys.shape[-1]
        if kernels.resolve_implementation(cfg.attention, capacity,
                                                cfg.attention_block) == "blocked":
            out = kernels.cached_attention(q, keys, values, None, query_slots,
                                                 block_size=cfg.attention_block)
            return out, (keys, values)
        out = _layer_layout_attention(q, keys.astype(cfg.dtype), values.astype(cfg.dtype),
                                      key_positions, positions, attend, cfg.dtype)
        return out, (keys, values)

def _output_projection(cfg, out, stored=None):
    """o_proj of the attention output [B, T, H, head_dim] -> [B, T, d_model], on the
    tokens flattened to [B*T, H, head_dim]; with `stored` [B, T, d_model] its recorded
    value (`StoredProjection`)."""
    batch, q_len = out.shape[:2]
    tokens = out.reshape((batch * q_len,) + out.shape[2:])
    kernel_names = ("heads", "head_dim", "embed")
    if stored is None:
        out = nn.DenseGeneral(
            features=cfg.d_model, axis=(-2, -1), use_bias=cfg.o_bias, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nn.with_logical_partitioning(weight_init(cfg), kernel_names),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            name="o_proj")(tokens)
    else:
        out = stored_projection(cfg, (cfg.d_model,), 2, kernel_names, ("embed",), cfg.o_bias,
                                "o_proj")(tokens, stored.reshape(batch * q_len, cfg.d_model))
    return out.reshape(batch, q_len, cfg.d_model)

def _layer_layout_attention(q, keys, values, key_positions, positions, attend, dtype):
    """Attention of q [B, T, H, Dh] over keys [B, KV, Dh, S] and values [B, KV, S, Dh]
    (a per-layer cache's layout) at key positions [S]; the mask as `_attention_probs`.
    Returns [B, T, H, Dh]."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv, capacity = keys.shape[1], keys.shape[-1]
    groups = num_heads // num_kv
    # Query rows [B, KV, G T, Dh], row g T + t: query t of head kv G + g.
    rows = q.reshape(batch, q_len, num_kv, groups, head_dim).transpose(
        0, 2, 3, 1, 4).reshape(batch, num_kv, groups * q_len, head_dim)
    scores = kernels.layer_scores(rows, keys).reshape(
            batch, num_kv, groups, q_len, capacity) / math.sqrt(head_dim)
    probs = _attention_probs(scores, key_positions[None], positions, attend, dtype)
    out = kernels.layer_mix(probs.reshape(batch, num_kv, groups * q_len, capacity), values)
    return out.reshape(batch, num_kv, groups, q_len, head_dim).transpose(
        0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim)

def _attention_probs(scores, key_pos, positions, attend, dtype):
    """softmax over the keys of float32 scores [B, KV, G, T, S], in `dtype`, each query
    seeing the keys `attend` [B or 1, T, S] allows, or (attend None) those whose position
    (key_pos [B or 1, S]) is <= its own (positions [B, T])."""
    if attend is None:
        allowed = key_pos[:, None, None, None, :] <= positions[:, None, None, :, None]
    else:
        allowed = attend[:, None, None, :, :]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)

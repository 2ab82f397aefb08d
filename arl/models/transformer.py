"""Decoder-only transformer language model (Llama / Qwen2 family) with a KV cache.

Architecture (Touvron et al. 2023, "LLaMA", arXiv 2302.13971; Qwen2 adds q/k/v biases,
Hugging Face Llama's `attention_bias` adds q/k/v and o_proj biases, its `mlp_bias` biases
on the three MLP projections):

    h_0 = E[tokens]
    for each layer l:
        a   = RMSNorm_l^attn(h)
        h  += o_proj(Attention(RoPE(q_proj a), RoPE(k_proj a), v_proj a))   # causal, GQA
        m   = RMSNorm_l^mlp(h)
        h  += down_proj(silu(gate_proj m) * up_proj m)                       # SwiGLU
    z = RMSNorm^final(h)
    logits = z @ W_lm   (W_lm = E^T when embeddings are tied)        -- float32
    value  = z @ w_v + b_v   (optional scalar head, the PPO critic)  -- float32

* RMSNorm(x) = x / sqrt(mean(x^2) + eps) * scale, computed in float32 (Zhang & Sennrich 2019).
* RoPE (Su et al. 2021, arXiv 2104.09864) in the "rotate-half" layout used by Hugging Face
  Llama/Qwen2: for frequencies f_i = theta^(-2i/head_dim), i < head_dim/2,
  x' = x * cos(p f) + rotate_half(x) * sin(p f), rotate_half([x1, x2]) = [-x2, x1].
* Attention scores and softmax are float32; softmax(q k^T / sqrt(head_dim) + mask).
* Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245): num_heads query heads
  share num_kv_heads key/value heads in groups of num_heads // num_kv_heads.

Parameter tree (names mirror Hugging Face so checkpoint import is a rename + reshape):

    embed_tokens/embedding                 [vocab, d_model]            ("vocab", "embed")
    layers/input_layernorm/scale           [L, d_model]                ("layers", "embed")
    layers/self_attn/q_proj/kernel         [L, d_model, H, head_dim]   ("layers", "embed", "heads", "head_dim")
    layers/self_attn/q_proj/bias           [L, H, head_dim]            (qkv_bias only)
    layers/self_attn/k_proj/kernel         [L, d_model, KV, head_dim]  ("layers", "embed", "kv_heads", "head_dim")
    layers/self_attn/v_proj/kernel         [L, d_model, KV, head_dim]
    layers/self_attn/o_proj/kernel         [L, H, head_dim, d_model]   ("layers", "heads", "head_dim", "embed")
    layers/self_attn/o_proj/bias           [L, d_model]                (o_bias only)
    layers/post_attention_layernorm/scale  [L, d_model]
    layers/mlp/gate_proj/kernel            [L, d_model, mlp_dim]       ("layers", "embed", "mlp")
    layers/mlp/up_proj/kernel              [L, d_model, mlp_dim]
    layers/mlp/down_proj/kernel            [L, mlp_dim, d_model]       ("layers", "mlp", "embed")
    layers/mlp/{gate,up}_proj/bias         [L, mlp_dim]                (mlp_bias only)
    layers/mlp/down_proj/bias              [L, d_model]                (mlp_bias only)
    norm/scale                             [d_model]
    lm_head                                [d_model, vocab]            ("embed", "vocab"), untied only
    value_head/kernel, value_head/bias     [d_model, 1], [1]           (value_head only)

The layers are stacked on a leading axis and run with `nn.scan`: one compiled layer body
whatever the depth, or `layer_unroll` layers per iteration in cache-free calls. With a
KV cache the scan carries the whole cache and each layer updates it in place. A HF tensor
`model.layers.{i}.self_attn.q_proj.weight` of shape [H*head_dim, d_model] is
`kernel[i] = weight.T.reshape(d_model, H, head_dim)`.

Positions and padding: by default token t of a row has position t (cache-free calls) or
its cache slot (cached calls), i.e. rows are left-aligned and padded at the end only.
`attention_mask` (1 = real token) handles padding anywhere, e.g. the left padding of
Hugging Face batched generation: padding is never attended to, real tokens get positions
counted over their row's real tokens only (cumsum(mask) - 1, as transformers' `generate`
does), and a cached call writes only the real tokens, packed from the row's current
length, so the cache never holds padding and decoding continues from each row's own count
of real tokens. `positions` overrides the RoPE positions (causality stays by sequence
order). Without either argument the computation is the plain one, operation for
operation.

Boxed parameters: every parameter is created through `nn.with_logical_partitioning`, so
`model.init(...)` returns `nn.LogicallyPartitioned` boxes. `model.apply` accepts boxed or
plain parameters. For optax and arithmetic, unbox once:

    variables = model.init(key, tokens)
    specs = param_partition_specs(variables["params"], LOGICAL_AXIS_RULES)   # needs the boxes
    params = nn.unbox(variables)["params"]                                  # plain arrays

`abstract_params(model)` gives the boxed shapes without allocating anything.

Separate critic: build a second `Transformer(dataclasses.replace(config, value_head=True))`
with its own parameters and use only its `values` output (its logits are simply ignored;
set `compute_logits=False` to skip the vocabulary projection). A shared-trunk critic is
the same model with `value_head=True` on the policy itself.

Beside this module: the hyper-parameters (`arl.models.transformer_config`), the KV cache
(`arl.models.kv_cache`), RoPE (`arl.models.rope`), the attention kernels
(`arl.models.attention`) and the mesh layout of parameters and activations
(`arl.models.partitioning`); this module re-exports their public names.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from arl.models import attention as attention_lib
from arl.models.activations import swiglu
from arl.models.kv_cache import (KVCache, check_cache_shapes, check_projections,
                                 init_cache, write_cache, write_layer_cache, write_projections)
from arl.models.partitioning import (ACTIVATION_AXIS_RULES, HEADS, KV_HEADS,
                                     LOGICAL_AXIS_RULES, LOGITS, MLP, RESIDUAL,
                                     constrain_activation, param_partition_specs,
                                     param_shardings)
from arl.models.projections import StoredProjection
from arl.models.rope import apply_rope, constant_rope_tables, rope_tables, rotate
from arl.models.transformer_config import (TransformerConfig, decodes_per_layer,
                                           projection_features)


# The model's public names, wherever they are defined (`from arl.models.transformer
# import KVCache` keeps working since the cache, the config, RoPE and the sharding rules
# moved to modules of their own).
__all__ = [
    "ACTIVATION_AXIS_RULES", "LOGICAL_AXIS_RULES", "KVCache", "ModelOutput", "RMSNorm",
    "Transformer", "TransformerConfig", "abstract_params", "apply_rope",
    "constrain_activation", "decodes_per_layer", "gather_embedding", "init_cache",
    "output_matrix", "param_partition_specs", "param_shardings", "per_layer_params",
    "projection_features", "rope_tables", "unembedding_matrix",
]


@struct.dataclass
class ModelOutput:
    """logits f32 [B, T, V] (None with compute_logits=False); values f32 [B, T] or None;
    cache (None without one); hidden [B, T, d_model] final-normed states when requested;
    projections {name: [num_layers, B, T, *features]}, the layers' projection outputs of
    the T tokens, with return_projections."""

    logits: jax.Array | None
    values: jax.Array | None
    cache: KVCache | None
    hidden: jax.Array | None = None
    projections: dict[str, jax.Array] | None = None


def _normal(config: TransformerConfig):
    return nn.initializers.normal(stddev=config.initializer_range)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, statistics in float32 (Zhang & Sennrich 2019)."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                           (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # HF casts back to the activation dtype before the scale multiply; keep that order
        # so bfloat16 checkpoints reproduce exactly.
        return normed.astype(self.dtype) * scale.astype(self.dtype)


def _projection(config, features, names, use_bias, name):
    return nn.DenseGeneral(
        features=features, axis=-1, use_bias=use_bias, dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=nn.with_logical_partitioning(_normal(config), ("embed",) + names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names), name=name)


def _stored_projection(config, features, input_axes, kernel_names, bias_names, use_bias,
                       name):
    """The parameters of the projection `name` (as its `nn.Dense` / `nn.DenseGeneral`
    declares them), applied with a recorded forward value (`StoredProjection`)."""
    return StoredProjection(
        features=tuple(features), input_axes=input_axes, use_bias=use_bias,
        dtype=config.dtype, param_dtype=config.param_dtype,
        kernel_init=nn.with_logical_partitioning(_normal(config), kernel_names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, bias_names), name=name)


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
        tokens use `arl.models.attention.causal_self_attention` instead (causal by
        sequence order, padding keys removed by `key_mask` bool [B, T] or None; `attend`
        is then None). Cached calls whose `config.attention` resolves to "blocked" for
        the S slots (auto: S > attention_block) use
        `arl.models.attention.cached_attention`, which reads only the blocks up to the
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
                out = _projection(cfg, (heads, head_dim), names, cfg.qkv_bias, name)(tokens)
            else:
                out = _stored_projection(cfg, (heads, head_dim), 1, ("embed",) + names, names,
                                         cfg.qkv_bias, name)(
                    tokens, stored[name].reshape(batch * q_len, heads, head_dim))
            out = constrain_activation(out.reshape(batch, q_len, heads, head_dim),
                                       activation_names)
            produced[name] = out
            return out

        q = project(num_heads, ("heads", "head_dim"), "q_proj", HEADS)
        k = project(num_kv, ("kv_heads", "head_dim"), "k_proj", KV_HEADS)
        v = project(num_kv, ("kv_heads", "head_dim"), "v_proj", KV_HEADS)
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
        implementation = attention_lib.resolve_implementation(cfg.attention, q_len,
                                                              cfg.attention_block)
        if cache_kv is None and implementation != "dense":
            out = attention_lib.causal_self_attention(
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
        elif attention_lib.resolve_implementation(
                cfg.attention, cache_kv[0].shape[2], cfg.attention_block) == "blocked":
            all_keys, all_values = write_cache(cache_kv, layer_index, write_positions, k, v)
            out = attention_lib.cached_attention(
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
        # every head pair, instead of a transposed copy of it (`attention.uses_head_pairs`).
        head_pairs = cache_kv is not None and attention_lib.uses_head_pairs(q_len)
        scores = attention_lib.grouped_scores(q, keys, head_pairs=head_pairs) / math.sqrt(
            head_dim)
        probs = _attention_probs(scores, key_pos, positions, attend, cfg.dtype)
        out = attention_lib.grouped_mix(probs, values, head_pairs=head_pairs).reshape(
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
        implementation = attention_lib.resolve_implementation(
            cfg.attention, prefix_len + q_len, cfg.attention_block)
        if implementation != "dense":
            # The prefix's positions get zero queries: causality by sequence order then
            # gives each token the prefix and the tokens before it; their outputs are
            # dropped.
            padded = jnp.concatenate(
                [jnp.zeros((batch, prefix_len) + q.shape[2:], q.dtype), q], axis=1)
            out = attention_lib.causal_self_attention(
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
        if attention_lib.resolve_implementation(cfg.attention, capacity,
                                                cfg.attention_block) == "blocked":
            out = attention_lib.cached_attention(q, keys, values, None, query_slots,
                                                 block_size=cfg.attention_block)
            return out, (keys, values)
        out = _layer_layout_attention(q, keys.astype(cfg.dtype), values.astype(cfg.dtype),
                                      key_positions, positions, attend, cfg.dtype)
        return out, (keys, values)


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
    scores = attention_lib.layer_scores(rows, keys).reshape(
            batch, num_kv, groups, q_len, capacity) / math.sqrt(head_dim)
    probs = _attention_probs(scores, key_positions[None], positions, attend, dtype)
    out = attention_lib.layer_mix(probs.reshape(batch, num_kv, groups * q_len, capacity), values)
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


def _per_layer_calls(cfg, layer_params, h, layer_caches, layer_args,
                     return_projections: bool = False, recorded=None):
    """The layers one after another, layer l on its own cache buffer (a per-layer
    `KVCache`) and on its parameters (slices of the stacked `layer_params`, or element l
    of their `per_layer_params` tuple): the computation of the scan over the stacked
    cache, layer by layer.

    Each layer writes and reads its own buffers in place (layer index None): inside a
    decoding loop nothing is copied per token, and the weight slices do not depend on the
    token, so XLA can take them once per loop.

    recorded: None, or (the cache's projection buffers {name: [L, B, S, ...]}, the
    slots [B, T] to write): each layer writes its projection outputs into its slice in
    place (stacking them first would copy every layer's outputs at every token).

    Returns (h, the per-layer cache's (keys, values), the layers' projection outputs
    stacked {name: [L, B, T, *features]} with `return_projections` (else None), the
    updated buffers with `recorded` (else None)).
    """
    params = _layer_slices(nn.meta.unbox(layer_params))
    # Computed once for all layers, as the scan's broadcast inputs are: without the
    # barrier XLA fuses the RoPE tables' sin / cos into every layer's rotations again.
    layer_args = jax.lax.optimization_barrier(layer_args)
    layer = DecoderLayer(cfg, return_projections=return_projections or recorded is not None,
                         parent=None)
    new_keys, new_values, produced = [], [], []
    buffers = None if recorded is None else recorded[0]
    for index, (one_layer, keys, values) in enumerate(zip(params, *layer_caches)):
        (h, (keys, values)), (_, outputs) = layer.apply(
            {"params": one_layer}, (h, (keys, values)), None, None, None, *layer_args)
        new_keys.append(keys)
        new_values.append(values)
        if buffers is not None:
            buffers = write_projections(buffers, recorded[1], outputs, layer_index=index)
        produced.append(outputs)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *produced) if return_projections else None
    return h, (tuple(new_keys), tuple(new_values)), stacked, buffers


def per_layer_params(params):
    """The model's parameters with the stacked layers (`params["layers"]`, leading axis
    num_layers) as a tuple of one tree per layer (a copy of the layer weights).

    Accepted, like the stacked form, by calls with a per-layer `KVCache`: a decoding loop
    that receives them takes every weight slice once, before the loop, instead of at
    every token.
    """
    params = dict(nn.meta.unbox(params))
    params["layers"] = _layer_slices(params["layers"])
    return params


def _layer_slices(layers) -> tuple:
    """Stacked layer parameters (leading axis num_layers) as one tree per layer; a tuple
    or list of per-layer trees as it is."""
    if isinstance(layers, (tuple, list)):
        return tuple(layers)
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    return tuple(jax.tree.map(lambda p, i=index: p[i], layers) for index in range(num_layers))


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
            kernel_init=nn.with_logical_partitioning(_normal(cfg), kernel_names),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            name="o_proj")(tokens)
    else:
        out = _stored_projection(cfg, (cfg.d_model,), 2, kernel_names, ("embed",), cfg.o_bias,
                                 "o_proj")(tokens, stored.reshape(batch * q_len, cfg.d_model))
    return out.reshape(batch, q_len, cfg.d_model)


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x) (Shazeer 2020, arXiv 2002.05202).

    The three projections run on the tokens flattened to [B*T, D] (a free reshape): on
    [B, T, D] the weight gradients contract two axes (B, T), and XLA's CPU backend then
    wrote the [B, T, mlp] gradient transposed to [mlp, B*T] before each weight-gradient
    matmul, about a third of the modest peer step (docs/performance.md, "Attention and
    the update"); flattened, every matmul is a plain 2-D one with no transposed copy.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, stored=None):
        """x [..., d_model] -> (output [..., d_model], the projections' outputs {name:
        [..., features]}); `stored`: recorded outputs of the three projections, taken as
        their forward values (`StoredProjection`), or None."""
        cfg = self.config
        leading = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        produced = {}

        def dense(x, features, names, name):
            if stored is None:
                out = nn.Dense(features, use_bias=cfg.mlp_bias, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype,
                               kernel_init=nn.with_logical_partitioning(_normal(cfg), names),
                               bias_init=nn.with_logical_partitioning(nn.initializers.zeros,
                                                                      names[-1:]),
                               name=name)(x)
            else:
                out = _stored_projection(cfg, (features,), 1, names, names[-1:], cfg.mlp_bias,
                                         name)(x, stored[name].reshape(-1, features))
            produced[name] = out.reshape(leading + (features,))
            return out

        gate = dense(x, cfg.mlp_dim, ("embed", "mlp"), "gate_proj")
        up = dense(x, cfg.mlp_dim, ("embed", "mlp"), "up_proj")
        # The activation sharding names [B, T, mlp]: constrained in that shape (free
        # reshapes; no operation at all without a mesh).
        hidden = constrain_activation(
            swiglu(gate, up).reshape(leading + (cfg.mlp_dim,)),
            MLP).reshape(-1, cfg.mlp_dim)
        out = dense(hidden, cfg.d_model, ("mlp", "embed"), "down_proj")
        return out.reshape(leading + (cfg.d_model,)), produced


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


def _checked_prefix(prefix_kv: KVCache, cfg: TransformerConfig, batch: int):
    """(keys, values) [L, B, P, KV, Dh] of a `prefix_kv`, checked against the model."""
    if not isinstance(prefix_kv, KVCache) or prefix_kv.is_per_layer:
        raise ValueError("Transformer: prefix_kv must be a stacked KVCache (as return_kv "
                         "gives)")
    expected = (cfg.num_layers, batch, prefix_kv.capacity, cfg.num_kv_heads,
                cfg.resolved_head_dim)
    if prefix_kv.keys.shape != expected or prefix_kv.values.shape != expected:
        raise ValueError(f"Transformer: prefix_kv keys and values must be [L, B, P, KV, Dh]"
                         f"={expected}, got {prefix_kv.keys.shape}, {prefix_kv.values.shape}")
    return prefix_kv.keys, prefix_kv.values


def _checked_positions(positions, batch: int, seq_len: int) -> jax.Array:
    positions = jnp.asarray(positions)
    if positions.shape != (batch, seq_len) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"Transformer: positions must be an integer array [B, T]="
                         f"({batch}, {seq_len}), got {positions.dtype} {positions.shape}")
    return positions.astype(jnp.int32)


def _checked_mask(attention_mask, batch: int, seq_len: int) -> jax.Array:
    """The padding mask as bool [B, T] (True = real token)."""
    mask = jnp.asarray(attention_mask)
    if mask.shape != (batch, seq_len) or not (
            mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise ValueError(f"Transformer: attention_mask must be a bool or integer array [B, T]="
                         f"({batch}, {seq_len}) (1 = real token, 0 = padding), got "
                         f"{mask.dtype} {mask.shape}")
    return mask.astype(bool)


class _CallLayout(NamedTuple):
    """Where the T tokens of one `Transformer` call sit, and what each query may see.

    positions: int32 [B, T], the tokens' RoPE positions.
    attend: None, or bool [B or 1, T, T] (cache-free) / [B, T, S] (cached): the keys
      each query sees; None lets the attention derive causality from the positions.
    key_mask: None, or bool [B, T], the real tokens as keys (the tiled kernels' padding
      mask, which they apply per block).
    prefix_layers: the keys and values of a `prefix_kv` ([L, B, P, KV, Dh] each) or None.
    layer_caches: the cache's (keys, values) or None.
    write_positions, slots: int32 [B, T], the cache slot each token is written to (the
      capacity for a token not written) and would occupy; key_positions: int32 [S], the
      cache's slots. None without a cache.
    num_valid: int32 [B], the tokens each row writes to the cache (else as given: None).
    """

    positions: jax.Array
    attend: jax.Array | None = None
    key_mask: jax.Array | None = None
    prefix_layers: tuple[jax.Array, jax.Array] | None = None
    layer_caches: tuple | None = None
    write_positions: jax.Array | None = None
    key_positions: jax.Array | None = None
    slots: jax.Array | None = None
    num_valid: jax.Array | None = None


def _after_prefix_layout(cfg, batch, seq_len, prefix_kv, positions, real) -> _CallLayout:
    """T tokens after the P positions of `prefix_kv`: positions P..P+T-1."""
    prefix_layers = _checked_prefix(prefix_kv, cfg, batch)
    if positions is not None or real is not None:
        raise ValueError("Transformer: prefix_kv does not combine with positions "
                         "or attention_mask")
    positions = jnp.broadcast_to(
        prefix_kv.capacity + jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    return _CallLayout(positions=positions, prefix_layers=prefix_layers)


def _cache_free_layout(cfg, batch, seq_len, positions, real) -> _CallLayout:
    """A cache-free call: causal over the T tokens, padding (`real` False) never seen."""
    explicit_positions = positions is not None
    attend = key_mask = None
    tiled = attention_lib.resolve_implementation(
        cfg.attention, seq_len, cfg.attention_block) != "dense"
    if not explicit_positions and real is None:
        positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32),
                                     (batch, seq_len))
    elif tiled:
        # No [B, T, T] mask: the tiled kernels mask per block from the key mask.
        key_mask = real
        if real is not None and not explicit_positions:
            positions = jnp.maximum(jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, 0)
    else:
        order = jnp.arange(seq_len, dtype=jnp.int32)
        attend = (order[None, :] <= order[:, None])[None]  # [1, T, T] causal
        if real is not None:
            attend = attend & real[:, None, :]
            if not explicit_positions:
                positions = jnp.maximum(
                    jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, 0)
    return _CallLayout(positions=positions, attend=attend, key_mask=key_mask)


def _cached_layout(cfg, batch, seq_len, cache: KVCache, positions, real, num_valid
                   ) -> _CallLayout:
    """A cached call: the tokens go to the slots after each row's length (padding is not
    written) and attend to every cached slot up to their own."""
    explicit_positions = positions is not None
    attend = None
    check_cache_shapes(cache, cfg, batch)
    if cache.length.shape != (batch,):
        raise ValueError(f"Transformer: cache.length must be [B]=({batch},), got "
                         f"{cache.length.shape}")
    if real is not None and num_valid is not None:
        raise ValueError("Transformer: pass either num_valid (padding at the end of "
                         "each row) or attention_mask, not both")
    if real is None:
        if num_valid is None:
            num_valid = jnp.full((batch,), seq_len, jnp.int32)
        num_valid = jnp.asarray(num_valid, jnp.int32)
        if num_valid.shape != (batch,):
            raise ValueError(f"Transformer: num_valid must be int32 [B]=({batch},), "
                             f"got shape {num_valid.shape}")
        offsets = jnp.arange(seq_len, dtype=jnp.int32)
        slots = cache.length[:, None] + offsets  # [B, T]
        write_positions = jnp.where(offsets < num_valid[:, None], slots,
                                    cache.capacity)
    else:
        # Real tokens are packed: the k-th real token of the chunk goes to slot
        # length + k; padding is dropped (written "past the capacity").
        slots = cache.length[:, None] + jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1
        write_positions = jnp.where(real, slots, cache.capacity)
        num_valid = jnp.sum(real, axis=1, dtype=jnp.int32)
    key_positions = jnp.arange(cache.capacity, dtype=jnp.int32)
    if explicit_positions or real is not None:
        attend = key_positions[None, None, :] <= slots[:, :, None]  # [B, T, S]
    if not explicit_positions:
        positions = slots
    return _CallLayout(positions=positions, attend=attend,
                       layer_caches=(cache.keys, cache.values),
                       write_positions=write_positions, key_positions=key_positions,
                       slots=slots, num_valid=num_valid)


class Transformer(nn.Module):
    """Decoder-only LM; see the module docstring for the architecture and parameters."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens, *, cache: KVCache | None = None, num_valid=None,
                 positions=None, attention_mask=None, compute_logits: bool = True,
                 return_hidden: bool = False, prefix_kv: KVCache | None = None,
                 return_kv: bool = False, projections: dict[str, jax.Array] | None = None,
                 return_projections: bool = False) -> ModelOutput:
        """tokens int32 [B, T].

        No cache: positions 0..T-1, causal attention over the T tokens (training /
          recomputation; sequences left-aligned, padding only at the end).
        With cache: the T tokens are appended to row b at positions
          cache.length[b] + arange(T); queries attend causally to every cached position <=
          their own. Writes past the capacity are dropped (outputs for such queries are
          meaningless). new_cache.length = length + num_valid (int32 [B], default T).
          Tokens t >= num_valid[b] are not written at all (stronger than "written but not
          counted": the cache of a row with num_valid 0 is bit-for-bit unchanged); their
          outputs are meaningless and valid queries never see them. This lets one call
          prefill a padded chunk, and lets finished rows idle during decoding.

        attention_mask: optional int/bool [B, T], 1/True = real token, 0/False = padding
          anywhere in the row (left padding as Hugging Face tokenizers produce for
          batched generation, right padding, or both). Padding tokens are never attended
          to and their own outputs are meaningless (finite).
          * No cache: query t sees the real tokens s <= t. Default positions: each real
            token's index among its row's real tokens (cumsum(mask) - 1, padding 0), so a
            padded row scores like the same row unpadded.
          * With cache: padding is not written at all. Real token t of row b goes to slot
            cache.length[b] + (number of real tokens of row b before t), so the cache
            holds only real tokens, packed from slot 0, and later calls (e.g. `generate`)
            never see the padding; the default position of a token is its slot, i.e.
            positions continue from each row's own count of real tokens.
            new_cache.length = length + mask.sum(1). Exclusive with num_valid (which is
            the special case mask[b, t] = t < num_valid[b]).
        positions: optional int [B, T] RoPE positions of the T tokens, overriding the
          defaults above (e.g. Hugging Face `position_ids`). Causality is by sequence
          order (slot order with a cache), not by position value, as in Hugging Face.
          With a cache, positions apply to this call only: a later call without them
          uses slot indices again.
        With neither positions nor attention_mask the computation is exactly the one
        described first (the same operations).

        compute_logits=False skips the vocabulary projection (logits None);
        return_hidden=True also returns the final-normed hidden states.

        Without a cache, two more arguments let a sequence be computed in two
        differentiable parts (e.g. a prompt once, then several continuations of it):
        return_kv=True returns the T tokens' rotated keys and values as `cache`, a
          stacked `KVCache` ([L, B, T, KV, Dh], length T).
        prefix_kv: such keys and values of P earlier positions (a stacked `KVCache` of
          capacity P, every slot filled, batch B): the T tokens are positions P..P+T-1
          and attend causally over the P positions and themselves, with any
          `config.attention`. Not with positions or attention_mask.

        Projections (the reuse of a rollout's activations by its update):
        return_projections=True returns every layer's projection outputs of the T tokens
          (`ModelOutput.projections`, {name: [L, B, T, *features]}, q/k/v before RoPE). A
          cached call whose cache has `projections` buffers (`init_cache(...,
          record_projections=True)`) writes them there at the slots it writes keys and
          values to, whatever this flag.
        projections: such outputs of these T tokens (cache-free calls): each projection
          takes its recorded output as its forward value and differentiates as the
          projection at that value (`arl.models.projections.stored_linear`), so the
          layers' matmuls run in the backward pass only. Recorded at the same parameters,
          the outputs are the ones computed here up to float summation order.

        Returns ModelOutput(logits f32 [B, T, V], values f32 [B, T] or None, new cache or
        None, hidden or None, projections or None).
        """
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"Transformer: tokens must be [B, T], got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"Transformer: tokens must be an integer array, got {tokens.dtype}")
        batch, seq_len = tokens.shape
        explicit_positions = positions is not None
        if explicit_positions:
            positions = _checked_positions(positions, batch, seq_len)
        real = None if attention_mask is None else _checked_mask(attention_mask, batch, seq_len)
        if cache is not None and (prefix_kv is not None or return_kv
                                  or projections is not None):
            raise ValueError("Transformer: prefix_kv, return_kv and projections apply to "
                             "cache-free calls")
        if cache is None and num_valid is not None:
            raise ValueError("Transformer: num_valid only applies together with cache")
        if projections is not None:
            check_projections(projections, cfg, (cfg.num_layers, batch, seq_len),
                              "projections")
        if prefix_kv is not None:
            layout = _after_prefix_layout(cfg, batch, seq_len, prefix_kv, positions, real)
        elif cache is None:
            layout = _cache_free_layout(cfg, batch, seq_len, positions, real)
        else:
            layout = _cached_layout(cfg, batch, seq_len, cache, positions, real, num_valid)
        positions, num_valid = layout.positions, layout.num_valid

        embed = nn.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=nn.with_logical_partitioning(_normal(cfg), ("vocab", "embed")),
            name="embed_tokens")
        # The lookup reads the table gathered over fsdp (as every FSDP weight is), so the
        # rows come out batch-sharded like the tokens, not split along d_model. (Loops of
        # forward passes gather it once beforehand: `gather_embedding`.)
        table = constrain_activation(embed.embedding, ("activation_vocab", "activation_embed"))
        h = constrain_activation(jnp.take(table.astype(cfg.dtype), tokens, axis=0), RESIDUAL)

        # Every layer rotates by the same angles. At the default positions 0..T-1 (no
        # cache, no mask: the training forward pass) they are constants of the program:
        # computed in it, XLA fused the cos and sin into each rotation and evaluated them
        # again for every head, in every layer, forward and backward.
        rope = None
        if cache is None and prefix_kv is None and not explicit_positions and real is None:
            rope = constant_rope_tables(seq_len, cfg.resolved_head_dim, cfg.rope_theta,
                                        cfg.dtype)
        if rope is None:
            rope = rope_tables(positions, cfg.resolved_head_dim, cfg.rope_theta, cfg.dtype)
        layer_args = (positions, rope, layout.write_positions, layout.key_positions,
                      layout.attend, layout.key_mask, layout.slots)
        recording = cache is not None and cache.projections is not None
        if recording:
            check_projections(cache.projections, cfg,
                               (cfg.num_layers, batch, cache.capacity), "cache.projections")
        recorded = None
        if cache is not None and cache.is_per_layer:
            h, new_layer_caches, produced, recorded = _per_layer_calls(
                cfg, self.variables["params"]["layers"], h, layout.layer_caches, layer_args,
                return_projections,
                (cache.projections, layout.write_positions) if recording else None)
        else:
            if isinstance(self.variables.get("params", {}).get("layers"), (tuple, list)):
                raise ValueError("Transformer: parameters with per-layer trees "
                                 "(`per_layer_params`) need a per-layer cache "
                                 "(`KVCache.per_layer()`); pass the stacked parameters")
            layer_cls = DecoderLayer
            if cfg.remat:
                layer_cls = nn.remat(layer_cls, prevent_cse=False)
            layers = nn.scan(
                layer_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(0, 0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast,
                         nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                # Cached calls keep one layer per iteration: their in-place update of the
                # stacked cache measured slower unrolled (docs/performance.md, "Attention
                # and the update"); a per-layer cache runs the layers one by one instead.
                unroll=min(cfg.layer_unroll, cfg.num_layers) if cache is None else 1,
                metadata_params={nn.PARTITION_NAME: "layers"})(
                    cfg, return_kv=return_kv,
                    return_projections=return_projections or recording, name="layers")
            (h, new_layer_caches), (token_kv, produced) = layers(
                (h, layout.layer_caches), jnp.arange(cfg.num_layers, dtype=jnp.int32),
                layout.prefix_layers, projections, *layer_args)

        hidden = constrain_activation(
            RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name="norm")(h), RESIDUAL)

        logits = None
        if compute_logits:
            if cfg.tie_embeddings:
                unembed = embed.embedding.T  # [D, V]
            else:
                unembed = self.param(
                    "lm_head",
                    nn.with_logical_partitioning(_normal(cfg), ("embed", "vocab")),
                    (cfg.d_model, cfg.vocab_size), cfg.param_dtype)
            # On the flattened tokens, like the layers' projections (no transposed copy
            # of the logits' gradient for the weight-gradient matmul).
            logits = jnp.einsum("nd,dv->nv", hidden.reshape(batch * seq_len, cfg.d_model),
                                unembed.astype(cfg.dtype),
                                preferred_element_type=jnp.float32).reshape(
                                    batch, seq_len, cfg.vocab_size)
            logits = constrain_activation(logits, LOGITS)

        values = None
        if cfg.value_head:
            values = nn.Dense(
                1, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                kernel_init=nn.with_logical_partitioning(_normal(cfg), ("embed", None)),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                name="value_head")(hidden.astype(jnp.float32))[..., 0]

        new_cache = None
        if cache is not None:
            if recording and recorded is None:
                recorded = write_projections(cache.projections, layout.write_positions,
                                             produced)
            new_cache = KVCache(keys=new_layer_caches[0], values=new_layer_caches[1],
                                length=cache.length + num_valid, projections=recorded)
        elif return_kv:
            new_cache = KVCache(keys=token_kv[0], values=token_kv[1],
                                length=jnp.full((batch,), seq_len, jnp.int32))
        return ModelOutput(logits=logits, values=values, cache=new_cache,
                           hidden=hidden if return_hidden else None,
                           projections=produced if return_projections else None)


def gather_embedding(params, config: TransformerConfig):
    """`params` with the embedding table in the activation dtype, laid out as the forward
    pass reads it (gathered over fsdp; no operation without an activation mesh).

    For loops of forward passes over the same parameters (a rollout's turns and decoded
    tokens): the forward pass gathers the table itself, and inside nested loops XLA kept
    one gathered copy per loop level, in float32 on XLA:CPU (which runs bfloat16
    collectives in float32): six [V, D] float32 buffers at the peak of Qwen2.5-0.5B's
    rollout on 64 devices (docs/performance.md, "Attention and the update"). Gathered
    once before the loops, the forward pass's own constraint is a no-op and one copy is
    kept. The values are the forward pass's own (the same cast, earlier): outputs are
    unchanged.
    """
    params = dict(params)
    embed = dict(params["embed_tokens"])
    table = nn.unbox(embed["embedding"]).astype(config.dtype)
    embed["embedding"] = constrain_activation(table, ("activation_vocab", "activation_embed"))
    params["embed_tokens"] = embed
    return params


def unembedding_matrix(params, config: TransformerConfig) -> jax.Array:
    """The [d_model, vocab] output projection: logits = hidden @ W (f32 accumulation).

    With `return_hidden=True, compute_logits=False` this lets callers compute log-probs
    in chunks without materialising [B, T, V] logits. Accepts plain or boxed params.
    """
    matrix, vocab_major = output_matrix(params, config)
    return matrix.T if vocab_major else matrix


def output_matrix(params, config: TransformerConfig) -> tuple[jax.Array, bool]:
    """(matrix, vocab_major): the output projection as stored, for
    `arl.models.logprobs.chunked_token_logprobs`: the tied embedding table [V, D]
    (vocab_major True), or the untied `lm_head` [D, V] (False). Reading the tied table as
    stored spares the transposed copy `unembedding_matrix` makes of it. Accepts plain or
    boxed params."""
    params = nn.unbox(params)
    if config.tie_embeddings:
        return params["embed_tokens"]["embedding"], True
    return params["lm_head"], False


def abstract_params(model: Transformer, batch_size: int = 1, seq_len: int = 1):
    """Boxed parameter shapes (`nn.LogicallyPartitioned` of ShapeDtypeStruct), no memory."""
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]

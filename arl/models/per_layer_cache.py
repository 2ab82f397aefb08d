"""Decoding on a per-layer KV cache (`KVCache.per_layer()`): the decoder layers run one
after another, each on its own cache buffers and its own parameter slice, instead of
the layer scan over the stacked cache."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from arl.models.decoder_layer import DecoderLayer
from arl.models.kv_cache import write_projections


def run_per_layer(cfg, layer_params, h, layer_caches, layer_args,
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

"""The decoder's KV cache: its two layouts (stacked and per layer), its in-place writes,
the shape checks of a cache handed to the model, and the buffers that record the layers'
projection outputs while decoding (for an update that reuses them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.models.transformer_config import TransformerConfig, projection_features


@struct.dataclass
class KVCache:
    """Per-layer keys/values of every position written so far, one row per sequence.

    keys, values: [num_layers, B, S, num_kv_heads, head_dim] (S = capacity), or, in the
      per-layer form (`per_layer()`), tuples of num_layers arrays, keys [B, num_kv_heads,
      head_dim, S] and values [B, num_kv_heads, S, head_dim]: one buffer per layer, which
      a decoding loop updates and reads in place (the stacked form makes XLA copy a
      layer's slice out at every token and layer), laid out as the attention's products
      read them (slots last for the keys, so a decoded token's scores run along them).
    length: int32 [B], number of valid positions of each row; position p of row b is
      valid iff p < length[b]. Entries at p >= length[b] are stale and never attended by
      valid queries. Padding (num_valid, attention_mask) is never written, so every
      slot below length[b] holds a real token.
    projections: None, or the layers' projection outputs at every written position, a
      dict {name: [num_layers, B, S, *features]} over
      `arl.models.projections.LAYER_PROJECTIONS` (q/k/v before RoPE), written by every
      cached call as keys and values are (`init_cache(..., record_projections=True)`):
      an update at the same parameters takes them as its forward values
      (`Transformer(..., projections=)`) instead of recomputing them.
    """

    keys: jax.Array | tuple[jax.Array, ...]
    values: jax.Array | tuple[jax.Array, ...]
    length: jax.Array
    projections: dict[str, jax.Array] | None = None

    @property
    def is_per_layer(self) -> bool:
        return isinstance(self.keys, (tuple, list))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[-1] if self.is_per_layer else self.keys.shape[2]

    def per_layer(self) -> KVCache:
        """The same cache as one buffer per layer, keys [B, KV, head_dim, S] and values
        [B, KV, S, head_dim] (a transposed copy of the cache)."""
        if self.is_per_layer:
            return self
        return self.replace(keys=tuple(k.transpose(0, 2, 3, 1) for k in self.keys),
                            values=tuple(v.transpose(0, 2, 1, 3) for v in self.values))

    def stacked(self) -> KVCache:
        """The same cache as [num_layers, B, S, num_kv_heads, head_dim] arrays."""
        if not self.is_per_layer:
            return self
        return self.replace(keys=jnp.stack([k.transpose(0, 3, 1, 2) for k in self.keys]),
                            values=jnp.stack([v.transpose(0, 2, 1, 3) for v in self.values]))


def init_cache(config: TransformerConfig, batch_size: int, capacity: int | None = None,
               dtype=jnp.float32, *, record_projections: bool = False) -> KVCache:
    """An empty cache (length 0 everywhere) for `batch_size` rows of `capacity` positions
    (default config.max_len); with `record_projections`, zeroed `KVCache.projections`
    buffers (in `dtype`) that every cached call fills at the positions it writes."""
    capacity = config.max_len if capacity is None else capacity
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"init_cache: batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"init_cache: capacity must be a positive int, got {capacity!r}")
    shape = (config.num_layers, batch_size, capacity, config.num_kv_heads,
             config.resolved_head_dim)
    projections = None
    if record_projections:
        projections = {name: jnp.zeros((config.num_layers, batch_size, capacity) + features,
                                       dtype)
                       for name, features in projection_features(config).items()}
    return KVCache(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype),
                   length=jnp.zeros((batch_size,), jnp.int32), projections=projections)


def write_cache(cache_kv, layer_index, write_positions, k, v):
    """The cache with this layer's new keys and values at `[layer_index, b,
    write_positions[b, t]]`."""
    all_keys, all_values = cache_kv
    batch_index = jnp.arange(k.shape[0])[:, None]
    # mode="drop": writes beyond capacity (or masked to capacity) vanish instead of
    # clamping onto the last slot as dynamic_update_slice would.
    all_keys = all_keys.at[layer_index, batch_index, write_positions].set(
        k.astype(all_keys.dtype), mode="drop")
    all_values = all_values.at[layer_index, batch_index, write_positions].set(
        v.astype(all_values.dtype), mode="drop")
    return all_keys, all_values


def write_layer_cache(layer_cache, write_positions, k, v):
    """One layer's buffers of a per-layer cache (keys [B, KV, Dh, S], values [B, KV, S,
    Dh]) with the new keys and values k, v [B, T, KV, Dh] at slots `write_positions[b,
    t]` (out-of-range writes dropped, as in `write_cache`)."""
    keys, values = layer_cache
    batch_index = jnp.arange(k.shape[0])[:, None]
    # The indexed axes are not adjacent, so the indexed window is [B, T, KV, Dh]: k's shape.
    keys = keys.at[batch_index, :, :, write_positions].set(k.astype(keys.dtype), mode="drop")
    values = values.at[batch_index, :, write_positions].set(v.astype(values.dtype),
                                                             mode="drop")
    return keys, values


def check_cache_shapes(cache: KVCache, cfg: TransformerConfig, batch: int):
    if cache.is_per_layer:
        capacity = cache.capacity if cache.keys else None
        kv, head_dim = cfg.num_kv_heads, cfg.resolved_head_dim
        keys_shape, values_shape = (batch, kv, head_dim, capacity), (batch, kv, capacity, head_dim)
        if (len(cache.keys) != cfg.num_layers or len(cache.values) != cfg.num_layers
                or any(x.shape != keys_shape for x in cache.keys)
                or any(x.shape != values_shape for x in cache.values)):
            shapes = sorted({x.shape for x in (*cache.keys, *cache.values)})
            raise ValueError(f"Transformer: a per-layer cache needs {cfg.num_layers} keys "
                             f"arrays of shape {keys_shape} (batch, kv_heads, head_dim, "
                             f"capacity) and {cfg.num_layers} values arrays of shape "
                             f"{values_shape} (batch, kv_heads, capacity, head_dim), got "
                             f"{len(cache.keys)} / {len(cache.values)} arrays of shapes "
                             f"{shapes}")
        return
    expected = (cfg.num_layers, batch, cache.capacity, cfg.num_kv_heads,
                cfg.resolved_head_dim)
    if cache.keys.shape != expected or cache.values.shape != expected:
        raise ValueError(f"Transformer: cache.keys/values must have shape {expected} "
                         f"(layers, batch, capacity, kv_heads, head_dim), got "
                         f"{cache.keys.shape} / {cache.values.shape}")


def check_projections(projections, cfg: TransformerConfig, leading: tuple[int, ...],
                      what: str):
    """Recorded projection outputs: a dict with every layer projection, each of shape
    `leading` + its features."""
    features = projection_features(cfg)
    if not isinstance(projections, dict) or set(projections) != set(features):
        raise ValueError(f"Transformer: {what} must be a dict with the keys "
                         f"{sorted(features)}, got "
                         f"{sorted(projections) if isinstance(projections, dict) else projections!r}")
    for name, size in features.items():
        if projections[name].shape != leading + size:
            raise ValueError(f"Transformer: {what}[{name!r}] must have shape {leading + size} "
                             f"(layers, batch, positions, features), got "
                             f"{projections[name].shape}")


def write_projections(buffers, write_positions, produced, layer_index=None):
    """The recorded projection buffers {name: [L, B, S, ...]} with the call's outputs
    {name: [L, B, T, ...]} (or layer `layer_index`'s, {name: [B, T, ...]}) at slots
    `write_positions` [B, T] (out-of-range writes dropped, as the cache's)."""
    batch_index = jnp.arange(write_positions.shape[0])[:, None]
    layers = slice(None) if layer_index is None else layer_index
    return {name: buffer.at[layers, batch_index, write_positions].set(
                produced[name].astype(buffer.dtype), mode="drop")
            for name, buffer in buffers.items()}

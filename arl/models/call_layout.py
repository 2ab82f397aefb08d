"""Where the tokens of one `Transformer` call sit: their RoPE positions, the keys each
query may see, and (with a KV cache) the slots they are written to. One function per kind
of call: cache-free (`cache_free_layout`), after a prefix (`after_prefix_layout`) and
cached (`cached_layout`); each checks its inputs and returns a `CallLayout`."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from arl.models import attention_kernels
from arl.models.kv_cache import KVCache, check_cache_shapes
from arl.models.transformer_config import TransformerConfig


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


def checked_positions(positions, batch: int, seq_len: int) -> jax.Array:
    positions = jnp.asarray(positions)
    if positions.shape != (batch, seq_len) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"Transformer: positions must be an integer array [B, T]="
                         f"({batch}, {seq_len}), got {positions.dtype} {positions.shape}")
    return positions.astype(jnp.int32)


def checked_mask(attention_mask, batch: int, seq_len: int) -> jax.Array:
    """The padding mask as bool [B, T] (True = real token)."""
    mask = jnp.asarray(attention_mask)
    if mask.shape != (batch, seq_len) or not (
            mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise ValueError(f"Transformer: attention_mask must be a bool or integer array [B, T]="
                         f"({batch}, {seq_len}) (1 = real token, 0 = padding), got "
                         f"{mask.dtype} {mask.shape}")
    return mask.astype(bool)


class CallLayout(NamedTuple):
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


def after_prefix_layout(cfg, batch, seq_len, prefix_kv, positions, real) -> CallLayout:
    """T tokens after the P positions of `prefix_kv`: positions P..P+T-1."""
    prefix_layers = _checked_prefix(prefix_kv, cfg, batch)
    if positions is not None or real is not None:
        raise ValueError("Transformer: prefix_kv does not combine with positions "
                         "or attention_mask")
    positions = jnp.broadcast_to(
        prefix_kv.capacity + jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    return CallLayout(positions=positions, prefix_layers=prefix_layers)


def cache_free_layout(cfg, batch, seq_len, positions, real) -> CallLayout:
    """A cache-free call: causal over the T tokens, padding (`real` False) never seen."""
    explicit_positions = positions is not None
    attend = key_mask = None
    tiled = attention_kernels.resolve_implementation(
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
    return CallLayout(positions=positions, attend=attend, key_mask=key_mask)


def cached_layout(cfg, batch, seq_len, cache: KVCache, positions, real, num_valid
                   ) -> CallLayout:
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
    return CallLayout(positions=positions, attend=attend,
                       layer_caches=(cache.keys, cache.values),
                       write_positions=write_positions, key_positions=key_positions,
                       slots=slots, num_valid=num_valid)

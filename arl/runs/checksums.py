"""Checksums of the arrays of a pytree, computed where the arrays live (one compiled
reduction per device set), and their non-finite counts.

    record = tree_checksums(state)        # {leaf name: LeafCheck}
    record["params.dense.kernel"].digest  # "9c1f03aa5e27d410"

A leaf's digest is two 32-bit lanes over its bits (typed PRNG keys: their key data),
each the sum modulo 2**32 of a mixed word per element:

    lane_1 = sum_i fmix32(w_i + i * 0x9E3779B9)
    lane_2 = sum_i fmix32(w_i ^ fmix32(i ^ 0x85EBCA6B))

where w_i is element i's bits as an unsigned 32-bit word (16- and 8-bit types
zero-extended, 64-bit types as two words) and fmix32 is MurmurHash3's finaliser, a
bijection of 32-bit words. For a fixed position both terms are bijections of w_i, so
any change to one element changes both lanes; changes to several elements cancel with
probability about 2**-64. Sums are exact and associative, so a sharded array's digest
equals the unsharded one's, on any layout, and every process computes the same value.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

ALGORITHM = "fmix32-sum-2x32"

_GOLDEN = np.uint32(0x9E3779B9)
_SALT = np.uint32(0x85EBCA6B)


class LeafCheck(NamedTuple):
    digest: str  # 16 hex digits: lane_1 then lane_2
    non_finite: int  # NaN and inf elements (0 for integer and key leaves)


def leaf_names(tree: Any) -> list[str]:
    """Leaf names as orbax writes them (key path joined by "."), in flattening order."""
    return [".".join(ocp.tree.str_keypath(path))
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(leaf: jax.Array) -> jax.Array:
    """The bits of `leaf` as uint32 words, same shape (plus a trailing 2 for 64-bit)."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if leaf.dtype == jnp.bool_:
        return leaf.astype(jnp.uint32)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        return _words(jnp.stack([jnp.real(leaf), jnp.imag(leaf)], axis=-1))
    width = np.dtype(leaf.dtype).itemsize
    if width == 4 or width == 8:  # 8 bytes: bitcast adds a trailing axis of 2 words
        return jax.lax.bitcast_convert_type(leaf, jnp.uint32)
    if width == 2:
        return jax.lax.bitcast_convert_type(leaf, jnp.uint16).astype(jnp.uint32)
    if width == 1:
        return jax.lax.bitcast_convert_type(leaf, jnp.uint8).astype(jnp.uint32)
    # Sub-byte types (int4): their values, zero-extended.
    return leaf.astype(jnp.int32).astype(jnp.uint32)


def _linear_index(shape: tuple[int, ...]) -> jax.Array:
    """Row-major element index, uint32 (wrapping past 2**32 elements), without a
    reshape (which would relayout a sharded array)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(
            stride % 2**32)
        stride *= shape[axis]
    return index


def _leaf_lanes(leaf: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    words = _words(leaf)
    index = _linear_index(words.shape)
    lane_1 = jnp.sum(_fmix32(words + index * _GOLDEN), dtype=jnp.uint32)
    lane_2 = jnp.sum(_fmix32(words ^ _fmix32(index ^ _SALT)), dtype=jnp.uint32)
    if jnp.issubdtype(leaf.dtype, jnp.inexact) and not jax.dtypes.issubdtype(
            leaf.dtype, jax.dtypes.prng_key):
        non_finite = jnp.sum(~jnp.isfinite(leaf), dtype=jnp.int32)
    else:
        non_finite = jnp.zeros((), jnp.int32)
    return lane_1, lane_2, non_finite


@functools.lru_cache(maxsize=None)
def _program(devices: tuple[jax.Device, ...]):
    """The jitted checksum of a list of leaves on `devices`, its results replicated there
    (readable by every process holding one of them)."""
    mesh = jax.sharding.Mesh(np.asarray(devices), ("devices",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda leaves: [_leaf_lanes(leaf) for leaf in leaves],
                   out_shardings=replicated)


def _devices(leaf: jax.Array) -> tuple[jax.Device, ...]:
    return tuple(sorted(leaf.sharding.device_set, key=lambda d: d.id))


def _local_value(array: jax.Array) -> int:
    return int(np.asarray(array.addressable_data(0)))


def tree_checksums(tree: Any) -> dict[str, LeafCheck]:
    """{leaf name: LeafCheck} of every array leaf of `tree` (jax or NumPy arrays, typed
    or raw PRNG keys); computed on the devices holding each leaf, one program per set
    of devices (the rollout mesh's parameters of an asynchronous run apart from the
    training mesh's)."""
    named = [(name, leaf) for name, leaf in zip(leaf_names(tree), jax.tree.leaves(tree))
             if isinstance(leaf, (jax.Array, np.ndarray, np.generic))]
    by_devices: dict[tuple[jax.Device, ...], list[tuple[str, jax.Array]]] = {}
    for name, leaf in named:
        if not isinstance(leaf, jax.Array):
            leaf = jnp.asarray(leaf)
        by_devices.setdefault(_devices(leaf), []).append((name, leaf))
    checks = {}
    for devices, group in by_devices.items():
        results = _program(devices)([leaf for _, leaf in group])
        for (name, _), (lane_1, lane_2, non_finite) in zip(group, results):
            checks[name] = LeafCheck(
                digest=f"{_local_value(lane_1):08x}{_local_value(lane_2):08x}",
                non_finite=_local_value(non_finite))
    return {name: checks[name] for name, _ in named}

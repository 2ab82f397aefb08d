"""Checksums of the arrays of a pytree, computed where the arrays live (one compiled
reduction per device set), and their non-finite counts.

    record = tree_checksums(state)        # {leaf name: LeafCheck}
    record["params.dense.kernel"].digest  # "9c1f03aa5e27d410"

A leaf's digest is two 32-bit lanes over its bits (typed PRNG keys: their key data),
sums modulo 2**32 over its elements i of one mixed word t_i:

    t_i    = fmix32(w_i + i * 0x9E3779B9)
    lane_1 = sum_i t_i
    lane_2 = sum_i t_i * (2 i + 1)

where w_i is element i's bits as an unsigned 32-bit word (16- and 8-bit types
zero-extended, 64-bit types as two words) and fmix32 is MurmurHash3's finaliser, a
bijection of 32-bit words. For a fixed position t_i is a bijection of w_i and the odd
weight a bijection of t_i, so any change to one element changes both lanes; two swapped
elements change them through the index; changes to several elements cancel in both
lanes with probability about 2**-64. One finaliser per word keeps the pass cheap on a
CPU. Sums are exact and associative, so a sharded array's digest equals the unsharded
one's, on any layout, and every process computes the same value.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

ALGORITHM = "fmix32-sum-weighted-2x32"

_GOLDEN = np.uint32(0x9E3779B9)


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


def _linear_index(shape: tuple[int, ...], offset=0) -> jax.Array:
    """Row-major element index plus `offset`, uint32 (wrapping past 2**32 elements),
    without a reshape (which would relayout a sharded array)."""
    index = jnp.zeros(shape, jnp.uint32) + jnp.asarray(offset, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(
            stride % 2**32)
        stride *= shape[axis]
    return index


def _block_lanes(block: jax.Array, sharding, offset) -> tuple[jax.Array, ...]:
    """Both lanes and the non-finite count of the elements of `block`, the first at
    linear index `offset`."""
    words = _words(block)
    index = _linear_index(words.shape, offset)
    if sharding is not None and words.shape == block.shape:
        # Laid out as the block: unconstrained, the partitioner computes the whole index
        # on every device (a full-size temporary each, and the work of all of them).
        index = jax.lax.with_sharding_constraint(index, sharding)
    if jnp.issubdtype(block.dtype, jnp.inexact) and not jax.dtypes.issubdtype(
            block.dtype, jax.dtypes.prng_key):
        non_finite = jnp.sum(~jnp.isfinite(block), dtype=jnp.int32)
    else:
        non_finite = jnp.zeros((), jnp.int32)
    mixed = _fmix32(words + index * _GOLDEN)
    return (jnp.sum(mixed, dtype=jnp.uint32),
            jnp.sum(mixed * (index * np.uint32(2) + np.uint32(1)), dtype=jnp.uint32),
            non_finite)


def _leading_axis_whole(leaf: jax.Array, sharding) -> bool:
    spec = getattr(sharding, "spec", None)
    return leaf.ndim >= 2 and (spec is None or len(spec) == 0 or spec[0] is None)


def _leaf_lanes(leaf: jax.Array, sharding) -> tuple[jax.Array, jax.Array, jax.Array]:
    if not _leading_axis_whole(leaf, sharding):
        return _block_lanes(leaf, sharding, 0)
    # One slice of the leading axis at a time (stacked layers, rows): XLA's CPU backend
    # does not fuse the mixing into a large reduction, so a whole-leaf sum holds three
    # leaf-sized temporaries; the scan holds one slice's.
    rest = (jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        *sharding.spec[1:])) if isinstance(sharding, jax.sharding.NamedSharding) else None)
    row_words = np.uint32(_row_words(leaf) % 2**32)

    def row(totals, inputs):
        block, r = inputs
        return tuple(t + x for t, x in zip(totals, _block_lanes(block, rest,
                                                                 r * row_words))), None

    zeros = (jnp.zeros((), jnp.uint32), jnp.zeros((), jnp.uint32), jnp.zeros((), jnp.int32))
    totals, _ = jax.lax.scan(row, zeros,
                             (leaf, jnp.arange(leaf.shape[0], dtype=jnp.uint32)))
    return totals


def _row_words(leaf: jax.Array) -> int:
    """uint32 words per slice of the leading axis."""
    words = jax.eval_shape(_words, jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype))
    return int(np.prod(words.shape))


@functools.lru_cache(maxsize=64)
def _program(devices: tuple[jax.Device, ...], shardings: tuple):
    """The jitted checksum of a list of leaves on `devices` laid out as `shardings`, its
    results replicated there (readable by every process holding one of them)."""
    mesh = jax.sharding.Mesh(np.asarray(devices), ("devices",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda leaves: [_leaf_lanes(leaf, sharding)
                                   for leaf, sharding in zip(leaves, shardings)],
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
        leaves = [leaf for _, leaf in group]
        results = _program(devices, tuple(leaf.sharding for leaf in leaves))(leaves)
        for (name, _), (lane_1, lane_2, non_finite) in zip(group, results):
            checks[name] = LeafCheck(
                digest=f"{_local_value(lane_1):08x}{_local_value(lane_2):08x}",
                non_finite=_local_value(non_finite))
    return {name: checks[name] for name, _ in named}


# ----------------------------------------------------------------- a checkpoint's record
def metadata_digest(metadata: Any) -> str:
    """The SHA-256 of a JSON object, canonical (sorted keys, no spaces)."""
    canonical = json.dumps(metadata, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def listing(names: list[str], shown: int = 4) -> str:
    """The first `shown` of `names`, then how many more."""
    more = f" (+{len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def integrity_record(state: Any, json_metadata: dict[str, Any]) -> tuple[dict, list[str]]:
    """(what a checkpoint stores to verify `state` and `json_metadata` by: each array's
    checksum and the metadata's SHA-256, the leaves with non-finite values as
    "<name> (<count>)")."""
    checks = tree_checksums(state)
    non_finite = [f"{name} ({check.non_finite})" for name, check in checks.items()
                  if check.non_finite]
    return {"algorithm": ALGORITHM, "metadata_sha256": metadata_digest(json_metadata),
            "arrays": {name: check.digest for name, check in checks.items()}}, non_finite


def integrity_problem(state: Any, metadata: dict[str, Any], record: Any) -> str | None:
    """None when `state` and `metadata` are what `record` (`integrity_record`) was made
    from; else what differs, in a few words."""
    if (not isinstance(record, dict) or record.get("algorithm") != ALGORITHM
            or not isinstance(record.get("arrays"), dict)):
        return "integrity record unreadable"
    if record.get("metadata_sha256") != metadata_digest(metadata):
        return "checksum mismatch in the JSON metadata"
    actual = {name: check.digest for name, check in tree_checksums(state).items()}
    expected = record["arrays"]
    differing = sorted(name for name in set(actual) | set(expected)
                       if actual.get(name) != expected.get(name))
    return f"checksum mismatch in {listing(differing)}" if differing else None
